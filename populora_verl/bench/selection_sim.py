"""Rating-dynamics simulation: which teachers does PBT keep under each match-outcome rule?

    python -m populora_verl.bench.selection_sim [--steps 200] [--seeds 20] [--out FILE.md]

No model: each teacher is a fixed mix of proposal kinds (invalid, unsolvable s̄ = 0, learnable 0 < s̄ < 1,
trivial s̄ = 1), each student a skill. Everything else is the real code: TrueSkill ratings and match outcomes
(``population.ratings``), PFSP matchmaking, ``PBTController`` plan + apply (victims, ``protect_top``, ``min_age``,
``child_rating``). An "adapter" is the member's trait vector and the operators perturb it (mutation: Gaussian
noise on the logits; crossover: their mean), so children resemble their parents as LoRA children do.

A child is damaged by its operator and recovers over ``recovery`` steps (the paper: about 20): until then an
extra ``1 - age / recovery`` share of its proposals is invalid (teachers) or its skill is lowered by that share
(students). This is what newborn protection (``pbt.min_age``) is about.

Figures per setting, means (± standard error) over seeds at the end of the run: the teachers' learnable / unsolvable /
invalid
shares (from their traits), the teachers' mean AZR learnability reward over the last ``interval`` steps, and the
share of culled members that were still recovering when they died.
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from populora_verl.config import load_config
from populora_verl.evolution.pbt import PBTController
from populora_verl.population import Matchmaker, Population

__all__ = ["SimConfig", "SimResult", "simulate", "main"]

KINDS = ("invalid", "stump", "learnable", "trivial")


@dataclass
class SimConfig:
    outcome: str = "learnable"
    min_age: int = 20
    child_rating: str = "prior"
    steps: int = 200
    interval: int = 10
    seeds: int = 20
    teachers: int = 4
    students: int = 4
    proposals: int = 12  # per teacher per step (4 per task type x 3 types)
    student_n: int = 8
    recovery: int = 20  # steps a child needs to recover from its operator
    zero_learnability_reward: float = -0.5


@dataclass
class SimResult:
    final_learnable: float
    final_stump: float
    final_invalid: float
    teacher_reward: float  # mean AZR teacher reward over the last interval
    recovering_culled: float  # share of victims still recovering (age < recovery) when culled
    seconds: float
    learnable_sem: float = 0.0  # standard error over seeds of final_learnable
    stump_sem: float = 0.0
    reward_sem: float = 0.0


class _Mutate:
    kind, num_parents, defaults = "mutation", 1, {}

    def __call__(self, parents, *, generator):
        return {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in parents[0].items()}


class _Cross:
    kind, num_parents, defaults = "crossover", 2, {}

    def __call__(self, parents, *, generator):
        return {k: (parents[0][k] + parents[1][k]) / 2 for k in parents[0]}


def _mix(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), -1).numpy()


def _one_run(cfg: SimConfig, seed: int) -> tuple[float, float, float, float, float]:
    pcfg = load_config(
        {
            "population": {"num_teachers": cfg.teachers, "num_students": cfg.students, "seed": seed},
            "matchmaking": {"outcome": cfg.outcome},
            "pbt": {"interval_steps": cfg.interval, "min_age": cfg.min_age, "child_rating": cfg.child_rating},
        }
    )
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    pop = Population.create(pcfg)
    mm = Matchmaker(pcfg.matchmaking, seed=seed + 1)
    ctl = PBTController(
        pcfg.pbt, seed=seed + 2, operators={"mutate": _Mutate(), "cross": _Cross()}, total_steps=cfg.steps
    )
    # Founder teachers: random mixes of proposal kinds; founder students: random skills (logit).
    traits = {m.id: {"x": torch.randn(len(KINDS) if m.role == "teacher" else 1, generator=g)} for m in pop.members}
    rewards: list[float] = []
    culled = recovering = 0
    for step in range(1, cfg.steps + 1):
        for t, s in mm.pairs(pop, step):
            tm, sm = pop.member(t), pop.member(s)
            mix = _mix(traits[t]["x"])
            damage_t = max(0.0, 1.0 - tm.age / cfg.recovery) if tm.parents else 0.0
            damage_s = max(0.0, 1.0 - sm.age / cfg.recovery) if sm.parents else 0.0
            skill = 1.0 / (1.0 + math.exp(-float(traits[s]["x"][0]))) * (1.0 - damage_s)
            rates, invalid = [], 0
            last = step > cfg.steps - cfg.interval
            for _ in range(cfg.proposals):
                kind = "invalid" if rng.random() < damage_t else KINDS[int(rng.choice(len(KINDS), p=mix))]
                if kind == "invalid":
                    invalid += 1
                    if last:
                        rewards.append(-1.0)
                    continue
                if kind == "stump":
                    rate = 0.0
                elif kind == "trivial":
                    rate = 1.0
                else:  # a learnable task: its difficulty against the student's skill
                    p = 1.0 / (1.0 + math.exp(-6.0 * (skill - rng.random())))
                    rate = float(rng.binomial(cfg.student_n, min(max(p, 0.05), 0.95))) / cfg.student_n
                rates.append(rate)
                if last:
                    rewards.append(1.0 - rate if 0.0 < rate < 1.0 else cfg.zero_learnability_reward)
            pop.ratings.rate_match(t, s, rates, cfg.outcome, invalid=invalid)
        pop.step = step
        pop.tick()
        if ctl.due(step):
            plan = ctl.plan(pop, step)
            for r in plan.replacements:
                culled += 1
                v = pop.member(r.victim_id)
                recovering += bool(v.parents) and v.age < cfg.recovery
            traits.update(ctl.apply(plan, pop, traits))
    final = np.mean([_mix(traits[m.id]["x"]) for m in pop.teachers()], axis=0)
    return (
        float(final[2]),
        float(final[1]),
        float(final[0]),
        float(np.mean(rewards)) if rewards else math.nan,
        recovering / culled if culled else 0.0,
    )


def simulate(cfg: SimConfig) -> SimResult:
    """Mean figures over ``cfg.seeds`` independent runs."""
    t0 = time.perf_counter()
    runs = [_one_run(cfg, seed) for seed in range(cfg.seeds)]
    cols = list(zip(*runs))

    def sem(c: Sequence[float]) -> float:
        return statistics.stdev(c) / math.sqrt(len(c)) if len(c) > 1 else 0.0

    return SimResult(
        *(statistics.fmean(c) for c in cols),
        seconds=time.perf_counter() - t0,
        learnable_sem=sem(cols[0]),
        stump_sem=sem(cols[1]),
        reward_sem=sem(cols[3]),
    )


def table(rows: Sequence[tuple[SimConfig, SimResult]]) -> str:
    head = (
        "| outcome | min_age | child_rating | learnable share | unsolvable share | invalid share | "
        "teacher reward (last interval) | culled while recovering |"
    )
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|"]
    for c, r in rows:
        lines.append(
            f"| {c.outcome} | {c.min_age} | {c.child_rating} | {r.final_learnable:.2f} ± "
            f"{r.learnable_sem:.2f} | {r.final_stump:.2f} ± {r.stump_sem:.2f} | {r.final_invalid:.2f} | "
            f"{r.teacher_reward:+.3f} ± {r.reward_sem:.3f} | {r.recovering_culled:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--outcomes", nargs="+", default=["vs_expected", "learnable"])
    p.add_argument("--min-ages", nargs="+", type=int, default=[0, 20])
    p.add_argument("--child-ratings", nargs="+", default=["prior", "inherit_inflate_sigma"])
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for outcome, min_age, child in itertools.product(args.outcomes, args.min_ages, args.child_ratings):
        c = SimConfig(
            outcome=outcome,
            min_age=min_age,
            child_rating=child,
            steps=args.steps,
            interval=args.interval,
            seeds=args.seeds,
        )
        rows.append((c, simulate(c)))
        print(f"# {outcome} min_age={min_age} {child}: {asdict(rows[-1][1])}", file=sys.stderr, flush=True)
    c0 = rows[0][0]
    text = (
        f"{c0.teachers}T+{c0.students}S, {args.steps} steps, evolution every {args.interval} "
        f"(last {args.interval} steps quiet), {c0.proposals} proposals per teacher per step, "
        f"{c0.student_n} answers each, recovery {c0.recovery} steps, {args.seeds} seeds per row "
        f"({time.perf_counter() - t0:.0f} s on {platform.machine()} / Python {platform.python_version()}).\n\n"
        + table(rows)
    )
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
