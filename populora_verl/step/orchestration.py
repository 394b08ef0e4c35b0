"""One PopuLoRA population step, independent of the engine that generates and trains.

The same object is driven by the CPU driver (:mod:`populora_verl.local`) and by the verl trainer, between their own
rollout phases::

    requests  = step.begin(n)                      # teacher prompts (with buffer references), one per proposal
    responses = engine.generate(requests)          # GenResponse(request, texts, lengths, extra) per request
    requests  = step.on_proposals(responses)       # validate in the executor -> student prompts (n samples/task)
    responses = engine.generate(requests)
    result    = step.on_answers(responses)         # rewards, teacher learnability, TrueSkill, TRR++ advantages
    for adapter, samples in result.updates.items(): engine.update(adapter, samples)
    plan, children = step.maybe_evolve(n, adapters)  # PBT every E steps; the engine writes children into slots

The single-agent AZR baseline (``populora.population.mode=single_agent``) is the same code: the one member ``a0``
is matched with itself, so it proposes and solves, and it is not rated (TrueSkill needs two players).

Decisions (documented in docs/cpu-driver.md, "Decisions in the population step"):

* A teacher's reward for a proposal is ``invalid_program`` (-1) if it is malformed or fails validation; otherwise
  the learnability of the proposal for its matched student(s): ``1 - s̄`` for ``0 < s̄ < 1`` else ``Z``
  (``rewards.teacher=one_minus``; ``inverse``: ``1 - s̄`` always), with ``s̄`` the mean correctness of the matched
  student's ``student_n`` answers (averaged over students when ``students_per_problem > 1``).
* When a teacher proposes no valid task of a type, each of its matched students gets buffer tasks of that type
  instead (the buffers are seeded with AZR's identity tasks, so there always is one), as many as the teacher would
  have produced. Students therefore always have data; these fallback answers train the student but never touch the
  teacher's reward, the pair's solve rate or the ratings. ``buffer.student_mix`` tops up every student this way.
* The match outcome uses the solve rates on the teacher's valid tasks only; a match without any valid task is a
  student win (``populora.population.ratings.match_outcomes``).
* Valid tasks enter the buffers after they are solved, filtered by ``buffer.valid_program_filter`` on ``s̄``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from populora_verl.advantage import group_keys, trrpp_advantages
from populora_verl.config import PopuLoRAConfig, load_config
from populora_verl.reward.levels import solve_rate, teacher_reward

__all__ = ["GenRequest", "GenResponse", "Sample", "StepResult", "PopulationStep"]

TEACHER = "teacher"
STUDENT = "student"


@dataclass
class GenRequest:
    """One prompt for one adapter, to be sampled ``n`` times. ``meta`` is the orchestration's bookkeeping."""

    adapter: str  # member id
    role: str  # teacher | student
    task_type: str
    prompt: Any  # str, or chat messages (list of {role, content}) when tasks.prompt_template=chat
    n: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenResponse:
    """The ``n`` completions of one request. ``lengths``: response tokens per completion (token-mean whitening,
    as verl; ``None`` counts each completion as one token). ``extra``: engine data per completion (token ids),
    handed back untouched in :attr:`Sample.extra`."""

    request: GenRequest
    texts: list[str]
    lengths: list[int] | None = None
    extra: list[Any] | None = None


@dataclass
class Sample:
    """One trajectory for one adapter's update: reward on the last token, scalar TRR++ advantage."""

    adapter: str
    role: str
    task_type: str
    prompt: Any
    response: str
    reward: float
    advantage: float = 0.0
    length: int = 1
    extra: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    step: int
    samples: list[Sample]  # every scored trajectory, teachers then students
    updates: dict[str, list[Sample]]  # member id -> the samples its update trains on
    metrics: dict[str, float]
    solve_rates: dict[tuple[str, str], float]  # (teacher, student) -> mean correctness on the teacher's tasks
    outcomes: dict[tuple[str, str], list[str]]  # rating games applied per pair


class PopulationStep:
    """The population step as phases with explicit data in and out (see the module docstring).

    Owns the population (members, ratings, lineage), the matchmaker, the PBT controller, the task buffers, the
    problem diagnostics (complexity + CVT coverage) and its own RNG; :meth:`state_dict` carries all of them but the
    population, which :mod:`populora_verl.checkpoint` saves with the adapters (``Population.save``).
    """

    def __init__(self, cfg: PopuLoRAConfig | Mapping[str, Any] | None = None, *, executor: Any = None,
                 seed: int | None = None, population: Any = None, tasks_env: Any = None) -> None:
        from populora_verl.diagnostics.tracker import ProblemDiagnostics
        from populora_verl.population import Matchmaker, Population

        self.cfg = cfg if isinstance(cfg, PopuLoRAConfig) else load_config(cfg)
        self.seed = int(self.cfg.population.seed if seed is None else seed)
        self.population = population if population is not None else Population.create(self.cfg)
        self.matchmaker = Matchmaker(self.cfg.matchmaking, seed=self.seed + 1)
        self.pbt = None
        if self.cfg.pbt.enabled and self.cfg.population.mode != "single_agent":
            from populora_verl.evolution.pbt import PBTController

            self.pbt = PBTController(self.cfg.pbt, seed=self.seed + 2)
            self.pbt.validate(self.cfg.population)
        from populora_verl.step.task_env import TaskEnv

        self.tasks = tasks_env if tasks_env is not None else TaskEnv(self.cfg, executor=executor)
        self.diagnostics = ProblemDiagnostics(self.cfg.diagnostics, seed=self.seed + 3,
                                              max_program_chars=self.cfg.tasks.max_program_chars)
        self._rng = np.random.Generator(np.random.PCG64(self.seed + 4))
        self.step = 0  # completed steps
        self.recent_rewards: dict[str, float] = {}
        self._phase = "idle"
        self._teacher_requests: list[GenRequest] = []
        self._teacher_records: list[dict[str, Any]] = []
        self._student_requests: list[GenRequest] = []
        self._pairs: list[tuple[str, str]] = []
        self._current = 0

    # --- phase 1: match + propose -------------------------------------------------------------------------

    def _task_types(self) -> list[str]:
        """The task type of each of a teacher's ``proposals_per_type x |types|`` prompts this step."""
        types = list(self.cfg.tasks.types)
        per = self.cfg.rollout.proposals_per_type
        if self.cfg.tasks.probabilities is None:
            return [t for t in types for _ in range(per)]
        p = np.asarray(self.cfg.tasks.probabilities, dtype=np.float64)
        draws = self._rng.choice(len(types), size=per * len(types), p=p / p.sum())
        return [types[i] for i in sorted(draws.tolist())]

    def begin(self, step: int) -> list[GenRequest]:
        """Match teachers with students and build the teacher (proposer) requests of step ``step``."""
        if self._phase != "idle":
            raise RuntimeError(f"PopulationStep.begin: previous step still in phase {self._phase!r}")
        self._current = int(step)
        self._pairs = self.matchmaker.pairs(self.population, self._current)
        requests = []
        for teacher in self.population.teachers():
            for task_type in self._task_types():
                prompt, meta = self.tasks.proposer_request(task_type, self._rng)
                meta.update(teacher=teacher.id)
                requests.append(GenRequest(teacher.id, TEACHER, task_type, prompt, self.cfg.rollout.teacher_n, meta))
        self._teacher_requests = requests
        self._phase = "proposing"
        return requests

    # --- phase 2: validate -> student requests ------------------------------------------------------------

    def _align(self, responses: Sequence[Any], requests: Sequence[GenRequest], what: str) -> list[GenResponse]:
        """Accept ``GenResponse`` objects or bare lists of texts aligned with ``requests``."""
        if len(responses) != len(requests):
            raise ValueError(f"{what}: got {len(responses)} responses for {len(requests)} requests")
        out = []
        for req, r in zip(requests, responses):
            resp = r if isinstance(r, GenResponse) else GenResponse(req, list(r))
            if len(resp.texts) != req.n:
                raise ValueError(f"{what}: request for {req.adapter}/{req.task_type} wanted {req.n} samples, "
                                 f"got {len(resp.texts)}")
            out.append(resp)
        return out

    def on_proposals(self, responses: Sequence[Any]) -> list[GenRequest]:
        """Validate each proposal through the executor; return the student (solver) requests."""
        if self._phase != "proposing":
            raise RuntimeError(f"PopulationStep.on_proposals called in phase {self._phase!r}")
        responses = self._align(responses, self._teacher_requests, "on_proposals")
        items = [(resp, k) for resp in responses for k in range(len(resp.texts))]
        verdicts = self.tasks.validate_many(
            [(r.request.task_type, r.texts[k], r.request.meta, r.request.adapter, self._current) for r, k in items])
        records = []
        for (resp, k), (task, status) in zip(items, verdicts):
            records.append({
                "adapter": resp.request.adapter, "task_type": resp.request.task_type, "prompt": resp.request.prompt,
                "response": resp.texts[k], "length": resp.lengths[k] if resp.lengths else 1,
                "extra": resp.extra[k] if resp.extra else None, "task": task, "status": status,
                "solve": {},  # student id -> list of correctness
            })
        self._teacher_records = records

        students_of: dict[str, list[str]] = {}
        for t, s in self._pairs:
            students_of.setdefault(t, []).append(s)
        n_ans = self.cfg.rollout.student_n
        quota = self.cfg.rollout.teacher_n * self.cfg.rollout.proposals_per_type
        requests: list[GenRequest] = []
        for teacher in self.population.teachers():
            mine = [(i, r) for i, r in enumerate(records) if r["adapter"] == teacher.id]
            for s in students_of.get(teacher.id, []):
                for i, r in mine:
                    if r["task"] is not None:
                        requests.append(GenRequest(s, STUDENT, r["task"].type, self.tasks.solver_request(r["task"]),
                                                   n_ans, {"task": r["task"], "teacher": teacher.id,
                                                           "record": i, "source": "teacher"}))
                asked = sorted({r["task_type"] for _, r in mine})
                for task_type in asked:
                    got = sum(1 for _, r in mine if r["task_type"] == task_type and r["task"] is not None)
                    want = quota - got if self.cfg.buffer.student_mix else (quota if got == 0 else 0)
                    for task in self.tasks.buffer_tasks(task_type, want, self._rng):
                        requests.append(GenRequest(s, STUDENT, task_type, self.tasks.solver_request(task), n_ans,
                                                   {"task": task, "teacher": teacher.id, "record": None,
                                                    "source": "buffer"}))
        self._student_requests = requests
        self._phase = "solving"
        return requests

    # --- phase 3: score, assemble rewards, rate, advantages ------------------------------------------------

    def on_answers(self, responses: Sequence[Any]) -> StepResult:
        """Score the answers; assemble teacher rewards from matched students; rate matches; TRR++ advantages."""
        if self._phase != "solving":
            raise RuntimeError(f"PopulationStep.on_answers called in phase {self._phase!r}")
        rw = self.cfg.rewards
        responses = self._align(responses, self._student_requests, "on_answers")
        items = [(resp, k) for resp in responses for k in range(len(resp.texts))]
        scores = self.tasks.score_many([(r.request.meta["task"], r.texts[k]) for r, k in items])

        student_samples: list[Sample] = []
        for (resp, k), (reward, correct) in zip(items, scores):
            req = resp.request
            if req.meta["record"] is not None:
                self._teacher_records[req.meta["record"]]["solve"].setdefault(req.adapter, []).append(bool(correct))
            if req.meta["source"] == "teacher" and not rw.train_on_estimation_rollouts:
                continue
            student_samples.append(Sample(
                req.adapter, STUDENT, req.task_type, req.prompt, resp.texts[k], float(reward),
                length=resp.lengths[k] if resp.lengths else 1, extra=resp.extra[k] if resp.extra else None,
                meta={"teacher": req.meta["teacher"], "source": req.meta["source"], "correct": bool(correct),
                      "task_id": req.meta["task"].id}))

        # Teacher rewards: learnability of each valid task for its matched student(s).
        teacher_samples: list[Sample] = []
        pair_rates: dict[tuple[str, str], list[float]] = {p: [] for p in self._pairs}
        new_tasks = []
        for rec in self._teacher_records:
            task = rec["task"]
            if task is None:
                reward, rate = teacher_reward(rec["status"], None, rw), None
            else:
                for s, c in rec["solve"].items():
                    if c:
                        pair_rates.setdefault((rec["adapter"], s), []).append(solve_rate(c))
                pooled = [c for cs in rec["solve"].values() for c in cs]
                rate = solve_rate(pooled) if pooled else None
                # No matched student answered (no students at all): the task taught nobody, reward Z.
                reward = teacher_reward("valid", rate, rw) if rate is not None else float(rw.zero_learnability_reward)
                new_tasks.append((task, rate))  # the buffer applies buffer.valid_program_filter
            teacher_samples.append(Sample(
                rec["adapter"], TEACHER, rec["task_type"], rec["prompt"], rec["response"], float(reward),
                length=rec["length"], extra=rec["extra"],
                meta={"status": rec["status"], "solve_rate": rate, "task_id": task.id if task else None}))

        # Ratings: one match per (teacher, student) pair over the teacher's valid tasks.
        outcomes = {}
        for (t, s), rates in pair_rates.items():
            outcomes[(t, s)] = self.population.ratings.rate_match(t, s, rates, self.cfg.matchmaking.outcome)
        solve_rates = {p: float(np.mean(r)) for p, r in pair_rates.items() if r}

        samples = teacher_samples + student_samples
        self._assign_advantages(samples)
        updates: dict[str, list[Sample]] = {m.id: [] for m in self.population.members}
        for smp in samples:
            updates.setdefault(smp.adapter, []).append(smp)

        valid_programs = [r["task"].program for r in self._teacher_records if r["task"] is not None]
        self.tasks.add_to_buffers(new_tasks)
        metrics = self._metrics(samples, solve_rates, valid_programs)
        self.recent_rewards = {m: float(np.mean([x.reward for x in xs])) for m, xs in updates.items() if xs}
        for m in self.population.members:
            self.recent_rewards.setdefault(m.id, 0.0)
        self.step = self._current
        self.population.step = self._current
        self._phase = "idle"
        self._teacher_requests, self._student_requests, self._teacher_records = [], [], []
        return StepResult(self._current, samples, updates, metrics, solve_rates, outcomes)

    def _assign_advantages(self, samples: list[Sample]) -> None:
        """TRR++ per group (default: adapter x task type x role), whitened over response tokens as verl does."""
        if not samples:
            return
        width = max(max(1, s.length) for s in samples)
        rewards = torch.zeros(len(samples), width, dtype=torch.float64)
        mask = torch.zeros(len(samples), width, dtype=torch.float64)
        for i, s in enumerate(samples):
            n = max(1, s.length)
            mask[i, :n] = 1.0
            rewards[i, n - 1] = s.reward  # outcome reward on the last response token
        subpops = [self.population.member(s.adapter).role for s in samples]
        keys = group_keys([s.adapter for s in samples], [s.task_type for s in samples], [s.role for s in samples],
                          subpops, self.cfg.advantage.group)
        adv, _ = trrpp_advantages(rewards, mask, keys, gamma=1.0, eps=self.cfg.advantage.eps)
        for i, s in enumerate(samples):
            # Reward only on the last token with gamma=1: the return, hence the advantage, is constant per sample.
            s.advantage = float(adv[i, 0])

    def _metrics(self, samples: Sequence[Sample], solve_rates: Mapping[tuple[str, str], float],
                 valid_programs: Sequence[str]) -> dict[str, float]:
        out: dict[str, float] = dict(self.population.ratings.metrics())
        for (t, s), r in solve_rates.items():
            out[f"populora/pair/{t}/{s}/solve_rate"] = r
        counts: dict[str, list[int]] = {}
        for rec in self._teacher_records:
            c = counts.setdefault(rec["adapter"], [0, 0])
            c[0] += rec["task"] is not None
            c[1] += 1
        for t, (v, n) in counts.items():
            out[f"populora/validity/{t}"] = v / n if n else 0.0
        total = sum(n for _, n in counts.values())
        out["populora/validity/mean"] = sum(v for v, _ in counts.values()) / total if total else 0.0
        out.update(self.diagnostics.observe(list(valid_programs), self._current))
        by_member: dict[str, list[float]] = {}
        by_role: dict[str, list[float]] = {}
        for s in samples:
            by_member.setdefault(s.adapter, []).append(s.reward)
            by_role.setdefault(s.role, []).append(s.reward)
        for m, rs in by_member.items():
            out[f"populora/reward/{m}/mean"] = float(np.mean(rs))
        for role, rs in by_role.items():
            out[f"populora/role/{role}/reward_mean"] = float(np.mean(rs))  # not an id: own prefix
        correct = [s.meta["correct"] for s in samples if s.role == STUDENT]
        if correct:
            out["populora/student/accuracy"] = float(np.mean(correct))
        out["populora/evolution/events"] = 0.0
        return out

    # --- phase 4: evolve -----------------------------------------------------------------------------------

    def maybe_evolve(self, step: int, adapters: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[Any, dict]:
        """PBT when due at ``step``: ``(EvolutionPlan, {child_id: state_dict})``, else ``(None, {})``.

        The engine writes each child into ``Replacement.victim_slot`` and resets that slot's optimizer state where
        ``Replacement.reset_optimizer`` is set."""
        if self.pbt is None or not self.pbt.due(step):
            return None, {}
        recent = self.recent_rewards if self.cfg.pbt.fitness == "recent_reward" else None
        plan = self.pbt.plan(self.population, step, recent)
        children = self.pbt.apply(plan, self.population, adapters)
        for r in plan.replacements:
            self.recent_rewards.pop(r.victim_id, None)
            self.recent_rewards[r.child_id] = 0.0
        return plan, children

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything this object owns except the population (saved with the adapters)."""
        if self._phase != "idle":
            raise RuntimeError("PopulationStep.state_dict: save between steps, not in phase " + repr(self._phase))
        return {
            "step": self.step,
            "seed": self.seed,
            "rng": self._rng.bit_generator.state,
            "matchmaker": self.matchmaker.state_dict(),
            "pbt": self.pbt.state_dict() if self.pbt is not None else None,
            "recent_rewards": dict(self.recent_rewards),
            "buffers": self.tasks.buffers_state(),
            "coverage": self.diagnostics.archive.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], population: Any = None) -> None:
        if population is not None:
            self.population = population
        self.step = int(state["step"])
        self.seed = int(state["seed"])
        self._rng = np.random.Generator(np.random.PCG64())
        self._rng.bit_generator.state = dict(state["rng"])
        self.matchmaker.load_state_dict(state["matchmaker"])
        if self.pbt is not None and state.get("pbt") is not None:
            self.pbt.load_state_dict(state["pbt"])
        self.recent_rewards = {k: float(v) for k, v in state.get("recent_rewards", {}).items()}
        self.tasks.load_buffers_state(state["buffers"])
        self.diagnostics.archive.load_state_dict(state["coverage"])
        self._phase = "idle"
