"""One standard for every claim: the paper's claims judged across seeds, with a verdict each.

``python -m populora_verl.diagnostics.claims --runs RUN_OR_FOLDER [...] [--eval RESULTS_OR_FOLDER ...] --out
CLAIMS.md`` reads a learning run's ``<arm>-seed<N>`` folders (``metrics.jsonl``; a results folder holding such
folders may be given instead) and its ``populora-eval`` results (``results.json`` with per-item outcomes; without
``--eval``, every ``eval/*/results.json`` inside a results folder given to ``--runs``) and prints:

* **Verdicts.** For every claim, one value per seed per arm, the effect (difference of the arms' means over seeds)
  and the exact two-sided permutation p over the seed labels (:func:`~populora_verl.diagnostics.dynamics.
  seed_permutation_p`), and a verdict by :func:`verdict`'s fixed rule. The claims: the complexity slope of the
  teachers' valid programs, CVT coverage at the end, how often pair solve rates change direction, training reward
  over the last steps (teachers, students, all members), and pass@1 on each benchmark and the code average (all
  members' mean, teachers, students, the weakest member) against the single agent; and teachers against students
  within the population on the benchmarks.
* **Secondary numbers**, labelled so and never behind a verdict: intervals over steps (the dynamics) or paired
  bootstrap intervals over benchmark items. They say how well one seed's number is pinned down, not whether another
  draw of seeds would agree.
* **Realised compute** per arm, seed and adapter: planned against realised trained trajectories per step, every
  step more than 10 % off its plan flagged.

Arms are the folder names without ``-seed<N>`` (:func:`~populora_verl.diagnostics.dynamics.arm_of`); the
single-agent arm is the one whose members are ``a<N>`` (``--single`` names it otherwise), every other arm a
population compared with it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from populora_verl.diagnostics.dynamics import (
    P,
    arm_of,
    compare_arms,
    direction_changes,
    group_arms,
    load_run,
    pair_series,
    seed_permutation_p,
    series,
)
from populora_verl.eval import arms as eval_arms
from populora_verl.eval.data import BENCHMARKS, CODE_BENCHMARKS

__all__ = [
    "ALPHA",
    "VERDICTS",
    "member_role",
    "smallest_p",
    "verdict",
    "judge",
    "find_runs",
    "find_eval",
    "split_arms",
    "dynamics_claims",
    "member_outcomes",
    "benchmark_claims",
    "compute_table",
    "markdown",
    "main",
]

#: The significance level of every verdict.
ALPHA = 0.05
VERDICTS = ("reproduced", "not reproduced", "cannot tell")
RULE = (
    "Fixed rule, the same for every claim: **reproduced** when the effect lies in the paper's direction and the "
    "exact two-sided permutation p over seed labels is below {alpha:g}; **not reproduced** when the effect is zero "
    "or opposite to the paper's direction (whatever p; 'significant the other way' is added when p is below "
    "{alpha:g}); **cannot tell** otherwise: the effect in the paper's direction with p of {alpha:g} or more, or "
    "fewer than 2 seeds with a value in an arm. Where the paper states no direction, a difference either way with "
    "p below {alpha:g} counts as reproduced and anything else as cannot tell. With n_a + n_b seeds the smallest p "
    "the test can give is 1 / C(n_a + n_b, n_a), twice that for equal arms (2 + 2: 0.33; 3 + 3: 0.10; 2 + 4: "
    "0.067; 4 + 4: 0.029): a claim whose seeds cannot reach p < {alpha:g} says so and can at best be cannot tell. "
    "'Not reproduced' means this run did not show the claim, not that it showed the opposite."
)
_ROLE_PREFIX = {"t": "teacher", "s": "student", "a": "both"}
_MEMBER = re.compile(r"^populora/(?:compute|rating|reward)/([tsa]\d+)/")
_GROUPS = ("all members", "teachers", "students", "weakest member")
_ROLE_ORDER = {"teacher": 0, "student": 1, "both": 2}


def member_role(member_id: str) -> str | None:
    """``t3`` -> teacher, ``s0`` -> student, ``a0`` -> both (the single agent); None for any other name."""
    m = re.match(r"^([tsa])\d+$", member_id)
    return _ROLE_PREFIX[m.group(1)] if m else None


# --- the test and the verdict ----------------------------------------------------------------------------------


def smallest_p(n_a: int, n_b: int) -> float | None:
    """The smallest p :func:`seed_permutation_p` can give with ``n_a`` and ``n_b`` seeds (distinct values, the arms
    fully apart): the observed split alone, and its mirror too when the arms are the same size. None below 2 seeds
    in an arm, where there is no test."""
    if n_a < 2 or n_b < 2:
        return None
    return (2 if n_a == n_b else 1) / math.comb(n_a + n_b, n_a)


def verdict(
    effect: float | None, p: float | None, direction: int, n_a: int, n_b: int, alpha: float = ALPHA
) -> tuple[str, list[str]]:
    """(verdict, notes) by :data:`RULE`. ``direction``: +1 when the paper says the compared side (b) is higher,
    -1 lower, 0 when it states no direction. ``n_a``, ``n_b``: seeds with a value on each side."""
    notes = []
    floor = smallest_p(n_a, n_b)
    if floor is not None and floor >= alpha:
        notes.append(f"cannot reach p < {alpha:g} with {n_b} + {n_a} seeds by construction (smallest p {floor:.3f})")
    if effect is None or p is None:
        return "cannot tell", [*notes, "fewer than 2 seeds with a value in an arm"]
    if direction == 0:
        return ("reproduced" if p < alpha else "cannot tell"), notes
    if effect * direction <= 1e-12:
        if p < alpha:
            notes.append("significant the other way")
        return "not reproduced", notes
    return ("reproduced" if p < alpha else "cannot tell"), notes


def judge(claim: dict[str, Any], alpha: float = ALPHA) -> dict[str, Any]:
    """``claim`` with ``effect`` (mean of side b minus mean of side a over seeds), ``p``, ``n_a``, ``n_b``,
    ``smallest_p``, ``verdict`` and ``notes`` filled in from its per-seed values ``a`` and ``b``
    ({seed run: value or None})."""
    a = [v for v in claim["a"].values() if v is not None]
    b = [v for v in claim["b"].values() if v is not None]
    claim["n_a"], claim["n_b"] = len(a), len(b)
    claim["effect"] = float(np.mean(b) - np.mean(a)) if a and b else None
    claim["p"] = seed_permutation_p(a, b)
    claim["smallest_p"] = smallest_p(len(a), len(b))
    claim["verdict"], claim["notes"] = verdict(claim["effect"], claim["p"], claim["direction"], len(a), len(b), alpha)
    return claim


def _claim(name: str, role: str, direction: int, unit: str, scale: float, digits: int, **kw: Any) -> dict[str, Any]:
    return {"claim": name, "role": role, "direction": direction, "unit": unit, "scale": scale, "digits": digits, **kw}


# --- inputs ----------------------------------------------------------------------------------------------------


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run folders: each path that holds ``metrics.jsonl``, else its sub-folders that do (a results folder)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(d for d in p.iterdir() if (d / "metrics.jsonl").is_file())
            if not found:
                raise FileNotFoundError(f"{p}: no metrics.jsonl in it or in its sub-folders")
            out += found
        else:
            raise FileNotFoundError(f"{p}: not a folder")
    names = [r.name for r in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two run folders named {', '.join(dup)}: a seed must be given once")
    return out


def find_eval(paths: Sequence[str | Path]) -> list[Path]:
    """``results.json`` files: each file given, and every ``results.json`` under each folder given."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(p.rglob("results.json"))
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    return out


def _run_members(run: Mapping[str, Any]) -> set[str]:
    return {m.group(1) for r in run["rows"].values() for k in r for m in [_MEMBER.match(k)] if m}


def split_arms(
    kinds: Mapping[str, set[str]], single: str | None = None, populations: Sequence[str] | None = None
) -> tuple[str, list[str]]:
    """(single-agent arm, population arms) from ``{arm: member ids seen}``: the single agent is the arm whose
    members are all ``a<N>`` unless ``single`` names it; the populations are ``populations`` or every other arm."""
    if single is None:
        singles = [a for a, ms in kinds.items() if ms and all(member_role(m) == "both" for m in ms)]
        if len(singles) != 1:
            raise ValueError(
                f"cannot tell the single-agent arm ({', '.join(singles) or 'none'} has only a<N> members); "
                "name it with --single"
            )
        single = singles[0]
    if single not in kinds:
        raise ValueError(f"--single {single}: no such arm (arms: {', '.join(kinds)})")
    pops = list(populations) if populations else [a for a in kinds if a != single]
    missing = [a for a in pops if a not in kinds]
    if missing:
        raise ValueError(f"--population {', '.join(missing)}: no such arm (arms: {', '.join(kinds)})")
    if not pops:
        raise ValueError("no population arm to compare with the single agent")
    return single, pops


# --- dynamics claims -------------------------------------------------------------------------------------------


def _last(rows: Mapping[int, Mapping[str, Any]], key: str, window: int) -> np.ndarray:
    return series(rows, key)[1][-window:]


def _all_members_reward(rows: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """Per step, the mean over the members trained that step of ``populora/reward/<id>/mean``."""
    out = {}
    for step, r in rows.items():
        vals = [
            float(v)
            for k, v in r.items()
            if re.match(r"^populora/reward/[^/]+/mean$", k) and isinstance(v, (int, float)) and math.isfinite(v)
        ]
        if vals:
            out[step] = {"all": float(np.mean(vals))}
    return out


def _window_difference(
    a: Sequence[np.ndarray], b: Sequence[np.ndarray], *, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float] | None:
    """Mean over b's seeds of their window means minus the same for a, with a 95 % percentile interval from
    resampling each seed's steps in the window: an interval over steps, like
    :func:`~populora_verl.diagnostics.dynamics.slope_difference`'s."""
    if not a or not b or any(len(x) == 0 for x in [*a, *b]):
        return None
    rng = np.random.default_rng(seed)

    def boot(xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.mean([x[rng.integers(0, len(x), (draws, len(x)))].mean(axis=1) for x in xs], axis=0)

    d = boot(b) - boot(a)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(np.mean([x.mean() for x in b]) - np.mean([x.mean() for x in a])), float(lo), float(hi)


def _interval(x: tuple[float, float, float] | None, scale: float, digits: int, label: str) -> str:
    if x is None:
        return f"{label}: –"
    return f"{label}: {scale * x[0]:+.{digits}f} [95 % {scale * x[1]:+.{digits}f}, {scale * x[2]:+.{digits}f}]"


def dynamics_claims(
    runs: Sequence[Mapping[str, Any]], single: str, populations: Sequence[str], window: int = 5
) -> list[dict[str, Any]]:
    """The training-dynamics claims, population arm (side b) against the single agent (side a), unjudged."""
    arms = group_arms(runs)
    ordered = [r for arm in [single, *populations] for r in arms[arm]]
    cmp = compare_arms(ordered, window)  # the single agent first: its differences are population - single
    out = []
    for pop in populations:
        a_runs, b_runs = arms[single], arms[pop]
        ca, cb = cmp["arms"][single], cmp["arms"][pop]
        diff = cmp["differences"][f"{pop} - {single}"]

        def per_seed(arm: Mapping[str, Any], key: str) -> dict[str, float | None]:
            vals = arm[key]
            return {
                name: (None if v is None else float(v[0] if isinstance(v, tuple) else v))
                for name, v in zip(arm["seeds"], vals)
            }

        common = {"population": pop, "single": single}
        out.append(
            _claim(
                "complexity: teachers' valid programs keep their cyclomatic complexity (slope per step)",
                "teachers",
                +1,
                "per step",
                1.0,
                4,
                b=per_seed(cb, "cyclomatic_slope"),
                a=per_seed(ca, "cyclomatic_slope"),
                secondary=_interval(diff["cyclomatic"], 1.0, 4, "over steps, slope difference")
                + "; "
                + _interval(diff["loc"], 1.0, 3, "lines-of-code slope difference, over steps"),
                **common,
            )
        )
        out.append(
            _claim(
                "coverage: CVT cells filled at the end",
                "teachers",
                +1,
                "cells",
                1.0,
                1,
                b=per_seed(cb, "cells_filled_last"),
                a=per_seed(ca, "cells_filled_last"),
                secondary="one count per seed, no interval over steps; valid programs behind it: population "
                + ", ".join(f"{v:.0f}" for v in cb["valid_programs"])
                + "; single "
                + ", ".join(f"{v:.0f}" for v in ca["valid_programs"]),
                **common,
            )
        )

        def rate(run: Mapping[str, Any]) -> float | None:
            ch, n = direction_changes([v for _, v in pair_series(run["rows"]).values()])
            return ch / n if n else None

        noise = {
            k: "–" if v is None else f"{v:.3f}"
            for k, v in (("pop", cb["direction_changes_noise_p"]), ("single", ca["direction_changes_noise_p"]))
        }
        out.append(
            _claim(
                "oscillation: pair solve rates change direction more often than the single agent's self-pair "
                "(changes per chance)",
                "pairs",
                +1,
                "per chance",
                1.0,
                3,
                b={r["name"]: rate(r) for r in b_runs},
                a={r["name"]: rate(r) for r in a_runs},
                secondary=f"within each arm over steps, shuffled-order p (one-sided, pooled): population "
                f"{noise['pop']}, single {noise['single']}",
                **common,
            )
        )
        keys = {
            "teachers": lambda rows: _last(rows, f"{P}role/teacher/reward_mean", window),
            "students": lambda rows: _last(rows, f"{P}role/student/reward_mean", window),
            "all members": lambda rows: _last(_all_members_reward(rows), "all", window),
        }
        for role, values in keys.items():
            va = {r["name"]: values(r["rows"]) for r in a_runs}
            vb = {r["name"]: values(r["rows"]) for r in b_runs}
            out.append(
                _claim(
                    f"training reward is lower for the population (mean of the last {window} steps)",
                    role,
                    -1,
                    "reward",
                    1.0,
                    3,
                    b={k: float(v.mean()) if len(v) else None for k, v in vb.items()},
                    a={k: float(v.mean()) if len(v) else None for k, v in va.items()},
                    secondary=_interval(
                        _window_difference([v for v in va.values() if len(v)], [v for v in vb.values() if len(v)]),
                        1.0,
                        3,
                        "over steps of the window",
                    ),
                    **common,
                )
            )
    return out


# --- benchmark claims ------------------------------------------------------------------------------------------


def member_outcomes(paths: Sequence[str | Path]) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """``{run: {member id: {benchmark: 0/1 outcomes per item}}}`` from ``populora-eval`` results files
    (:func:`populora_verl.eval.arms.load_outcomes`), members named ``<run>[@<step>].<id>``; a run evaluated at
    several steps keeps its latest. The base model is left out."""
    outcomes = eval_arms.load_outcomes(paths)
    latest: dict[str, int] = {}
    entries = []
    for bench, members in outcomes.items():
        for name, v in members.items():
            if "." not in name:
                continue
            head, mid = name.split(".", 1)
            run, _, step = head.partition("@")
            step_n = int(step) if step.isdigit() else -1
            latest[run] = max(latest.get(run, step_n), step_n)
            entries.append((run, step_n, mid, bench, v))
    out: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for run, step_n, mid, bench, v in entries:
        if step_n == latest[run]:
            out.setdefault(run, {}).setdefault(mid, {})[bench] = v
    return out


def _score(arrays: Mapping[str, np.ndarray], column: str, code: Sequence[str]) -> float | None:
    if column != "code avg":
        return float(arrays[column].mean()) if column in arrays else None
    if not code or any(b not in arrays for b in code):
        return None
    return float(np.mean([arrays[b].mean() for b in code]))


def _group(
    members: Mapping[str, Mapping[str, np.ndarray]], group: str, column: str, code: Sequence[str]
) -> tuple[float | None, dict[str, np.ndarray]]:
    """(one seed's value of ``group`` on ``column``, the per-item scores behind it per benchmark): the mean over the
    group's members, or the weakest member's own (the lowest score on ``column``)."""
    role = {"teachers": "teacher", "students": "student"}.get(group)
    ids = sorted(m for m in members if role is None or member_role(m) == role)
    benches = list(code) if column == "code avg" else [column]
    ids = [m for m in ids if _score(members[m], column, code) is not None]
    if not ids:
        return None, {}
    if group == "weakest member":
        ids = [min(ids, key=lambda m: _score(members[m], column, code))]
    value = float(np.mean([_score(members[m], column, code) for m in ids]))
    return value, {b: np.mean([members[m][b] for m in ids], axis=0) for b in benches}


def _item_interval(
    b_items: Sequence[Mapping[str, np.ndarray]], a_items: Sequence[Mapping[str, np.ndarray]], column: str
) -> tuple[float, float, float] | None:
    """The paired bootstrap over items (:func:`populora_verl.eval.arms.paired_difference`) of the per-item scores
    averaged over each side's seeds."""
    benches = [bench for bench in (b_items[0] if b_items else {}) if all(bench in x for x in [*b_items, *a_items])]
    if not benches or not a_items:
        return None
    scores = {
        bench: {"b": np.mean([x[bench] for x in b_items], axis=0), "a": np.mean([x[bench] for x in a_items], axis=0)}
        for bench in benches
    }
    d = eval_arms.paired_difference(scores, "b", "a")
    return d["code avg" if column == "code avg" else column]


def _display(column: str) -> str:
    return BENCHMARKS[column].display if column in BENCHMARKS else column


def benchmark_claims(
    outcomes: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]], single: str, populations: Sequence[str]
) -> list[dict[str, Any]]:
    """Pass@1 per benchmark and the code average: each population group against the single agent, and teachers
    against students within the population; one value per evaluated seed, unjudged."""
    by_arm: dict[str, dict[str, Mapping[str, Mapping[str, np.ndarray]]]] = {}
    for run, members in outcomes.items():
        by_arm.setdefault(arm_of(run), {})[run] = members
    benches = [b for b in BENCHMARKS if any(b in arr for ms in outcomes.values() for arr in ms.values())]
    benches += [
        b for b in sorted({b for ms in outcomes.values() for arr in ms.values() for b in arr}) if b not in benches
    ]
    code = [b for b in CODE_BENCHMARKS if b in benches]
    columns = benches + (["code avg"] if code else [])
    singles = by_arm.get(single, {})
    out = []
    for pop in populations:
        runs = by_arm.get(pop, {})
        for column in columns:
            a_vals, a_items = {}, []
            for run, members in singles.items():
                v, items = _group(members, "all members", column, code)
                a_vals[run] = v
                if v is not None:
                    a_items.append(items)
            common = {"population": pop, "single": single}
            per_group: dict[str, tuple[dict[str, float | None], list[dict[str, np.ndarray]]]] = {}
            for group in _GROUPS:
                vals, items = {}, []
                for run, members in runs.items():
                    v, it = _group(members, group, column, code)
                    vals[run] = v
                    if v is not None:
                        items.append(it)
                per_group[group] = (vals, items)
                label = "over items, paired bootstrap" + (", weakest chosen on all items" if "weakest" in group else "")
                out.append(
                    _claim(
                        f"{_display(column)} pass@1: the population beats the single agent",
                        group,
                        +1,
                        "points",
                        100.0,
                        1,
                        b=vals,
                        a=a_vals,
                        secondary=_interval(_item_interval(items, a_items, column), 100.0, 1, label),
                        **common,
                    )
                )
            (tv, ti), (sv, si) = per_group["teachers"], per_group["students"]
            out.append(
                _claim(
                    f"{_display(column)} pass@1: teachers and students differ (no direction stated)",
                    "teachers vs students",
                    0,
                    "points",
                    100.0,
                    1,
                    b=tv,
                    a=sv,
                    secondary=_interval(_item_interval(ti, si, column), 100.0, 1, "over items, paired bootstrap"),
                    population=pop,
                    single=f"{pop} students",
                )
            )
    return out


# --- realised compute ------------------------------------------------------------------------------------------


def _config_plan(run_dir: Path) -> Any:
    """The run's per-role plan from ``config_as_run.yaml`` (:func:`populora_verl.step.compute.compute_plan`), or
    None when the file is missing or unreadable."""
    path = run_dir / "config_as_run.yaml"
    if not path.is_file():
        return None
    try:
        import yaml

        from populora_verl.config import load_config
        from populora_verl.step.compute import compute_plan

        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return compute_plan(load_config(data.get("populora")))
    except Exception:  # any reason the plan cannot be rebuilt: fall back to the logged mean
        return None


def _ranges(steps: Sequence[int]) -> str:
    steps = sorted(steps)
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}–{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def compute_table(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per run and adapter: planned and realised trained trajectories per step and the steps off the plan
    by more than :data:`populora_verl.step.compute.PLAN_TOLERANCE` of it (``|realised - planned| > 10 % x planned``,
    as the trainer's own warning). Realised: ``populora/compute/<id>/realised``, else ``.../trajectories``. Planned:
    ``populora/compute/<id>/planned`` where logged, else the role's plan rebuilt from the run's
    ``config_as_run.yaml``, else the logged member mean ``populora/compute/planned_trajectories`` (marked)."""
    from populora_verl.step.compute import PLAN_TOLERANCE

    out = []
    for run in runs:
        rows = run["rows"]
        members = sorted(
            {
                k.split("/")[2]
                for r in rows.values()
                for k in r
                if re.match(r"^populora/compute/[^/]+/(trajectories|realised)$", k) and "/member_mean/" not in k
            },
            key=lambda m: (_ROLE_ORDER.get(member_role(m), 3), int(m[1:]) if m[1:].isdigit() else 0, m),
        )
        plan = _config_plan(Path(run["path"])) if run.get("path") else None
        for m in members:
            role = member_role(m)
            steps, planned, realised, sources = [], [], [], set()
            for step, r in rows.items():
                got = r.get(f"{P}compute/{m}/realised", r.get(f"{P}compute/{m}/trajectories"))
                if not isinstance(got, (int, float)):
                    continue
                want = r.get(f"{P}compute/{m}/planned")
                if isinstance(want, (int, float)):
                    sources.add("logged")
                elif plan is not None and role is not None:
                    want = plan.of_role(role)
                    sources.add("config")
                elif isinstance(r.get(f"{P}compute/planned_trajectories"), (int, float)):
                    want = r[f"{P}compute/planned_trajectories"]
                    sources.add("member mean")
                else:
                    want = None
                steps.append(step)
                realised.append(float(got))
                planned.append(None if want is None else float(want))
            off = [
                (s, g, w)
                for s, g, w in zip(steps, realised, planned)
                if w is not None and (abs(g - w) > PLAN_TOLERANCE * w if w > 0 else g > 0)
            ]
            out.append(
                {
                    "arm": arm_of(run["name"]),
                    "run": run["name"],
                    "adapter": m,
                    "role": role or "?",
                    "steps": steps,
                    "planned": planned,
                    "realised": realised,
                    "plan_source": "/".join(sorted(sources)) or "not logged",
                    "off_plan": off,
                }
            )
    return out


# --- output ----------------------------------------------------------------------------------------------------


def _num(x: float | None, scale: float, digits: int, sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{scale * x:{'+' if sign else ''}.{digits}f}"


def _seed_label(run: str) -> str:
    m = re.search(r"seed(\d+)$", run)
    return f"seed {m.group(1)}" if m else run


def _direction(c: Mapping[str, Any]) -> str:
    if c["direction"] == 0:
        return "either"
    return "population higher" if c["direction"] > 0 else "population lower"


def markdown(
    claims: Sequence[Mapping[str, Any]],
    compute: Sequence[Mapping[str, Any]],
    *,
    inputs: Sequence[str] = (),
    alpha: float = ALPHA,
) -> str:
    lines = ["# The paper's claims, judged across seeds", ""]
    if inputs:
        lines += [*inputs, ""]
    lines += [
        RULE.format(alpha=alpha),
        "",
        "## Verdicts (primary: exact permutation of seed labels, two-sided)",
        "",
        "Effect = mean over the compared side's seeds minus mean over the single agent's (teachers minus students "
        "for the within-population rows); benchmark effects in percentage points. Seeds: the compared side's + the "
        "single agent's (or the students'), those with a value.",
        "",
        "| claim | role | paper's direction | effect | seeds | p | verdict | note |",
        "|---|---|---|---:|---|---:|---|---|",
    ]
    for c in claims:
        p = "–" if c["p"] is None else f"{c['p']:.3f}"
        lines.append(
            f"| {c['claim']} | {c['role']} | {_direction(c)} | {_num(c['effect'], c['scale'], c['digits'], True)} "
            f"{c['unit']} | {c['n_b']} + {c['n_a']} | {p} | **{c['verdict']}** | {'; '.join(c['notes']) or ''} |"
        )
    counts = {v: sum(c["verdict"] == v for c in claims) for v in VERDICTS}
    lines += [
        "",
        "Verdicts: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".",
        "",
        "## Per-seed values and secondary intervals (not the verdict)",
        "",
        "Secondary intervals resample steps within each seed (dynamics) or benchmark items (benchmarks): they say how "
        "well each seed's number is pinned down, not whether other seeds would agree.",
        "",
        "| claim | role | compared side, per seed | single agent (or students), per seed | secondary |",
        "|---|---|---|---|---|",
    ]
    for c in claims:

        def vals(d: Mapping[str, float | None], c: Mapping[str, Any] = c) -> str:
            return ", ".join(f"{_seed_label(k)} {_num(v, c['scale'], c['digits'])}" for k, v in d.items()) or "–"

        lines.append(
            f"| {c['claim']} | {c['role']} | {c['population']}: {vals(c['b'])} | {c['single']}: {vals(c['a'])} | "
            f"{c['secondary']} |"
        )
    lines += [
        "",
        "## Realised compute per adapter (trained trajectories per step)",
        "",
        "Plan per step: logged per adapter (`populora/compute/<id>/planned`), else the role's plan rebuilt from the "
        "run's `config_as_run.yaml` (config), else the logged member mean (`populora/compute/planned_trajectories`, "
        "member mean: not a per-adapter plan). A step is flagged when realised differs from planned by more than "
        "10 % of the plan.",
        "",
        "| arm | seed | adapter | role | steps alive | planned per step (from) | realised per step: mean (min–max) "
        "| realised / planned, total | steps > 10 % off plan |",
        "|---|---|---|---|---:|---|---|---|---|",
    ]
    flags = []
    for r in compute:
        plans = sorted({w for w in r["planned"] if w is not None})
        plan = "–" if not plans else "/".join(f"{w:g}" for w in plans)
        got = np.asarray(r["realised"])
        total_plan = sum(w for w in r["planned"] if w is not None)
        off = r["off_plan"]
        lines.append(
            f"| {r['arm']} | {_seed_label(r['run'])} | {r['adapter']} | {r['role']} | {len(r['steps'])} | {plan} "
            f"({r['plan_source']}) | {got.mean():.1f} ({got.min():g}–{got.max():g}) | {got.sum():g} / "
            f"{total_plan:g} | {len(off)}" + (f": {_ranges([s for s, _, _ in off])}" if off else "") + " |"
        )
        if off:
            by_value: dict[tuple[float, float], list[int]] = {}
            for s, g, w in off:
                by_value.setdefault((g, w), []).append(s)
            flags.append(
                f"- **{r['run']} {r['adapter']}** ({r['role']}) off its plan on {len(off)} of {len(r['steps'])} "
                "steps: "
                + "; ".join(f"{g:g} of {w:g} on step {_ranges(ss)}" for (g, w), ss in sorted(by_value.items()))
            )
    lines += ["", *(flags or ["No adapter was more than 10 % off its plan on any step."])]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.diagnostics.claims", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--runs",
        nargs="+",
        required=True,
        help="run folders (<arm>-seed<N> with metrics.jsonl) or folders holding them",
    )
    ap.add_argument(
        "--eval",
        nargs="*",
        help="populora-eval results.json files or folders searched for them (default: <folder>/eval of each "
        "results folder given to --runs)",
    )
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--window", type=int, default=5, help="last steps averaged for the training reward (default 5)")
    ap.add_argument("--alpha", type=float, default=ALPHA, help=f"significance level of the verdicts (default {ALPHA})")
    ap.add_argument("--single", help="the single-agent arm (default: the arm whose members are a<N>)")
    ap.add_argument(
        "--population", action="append", help="a population arm to judge (repeatable; default every other arm)"
    )
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be >= 1")
    if not 0 < args.alpha < 1:
        ap.error("--alpha must be between 0 and 1")
    try:
        run_dirs = find_runs(args.runs)
        runs = []
        for d in run_dirs:
            run = load_run(d)
            run["path"] = str(d)
            runs.append(run)
        if args.eval is None:
            eval_paths = find_eval([Path(p) / "eval" for p in args.runs if (Path(p) / "eval").is_dir()])
        else:
            eval_paths = find_eval(args.eval)
        outcomes = member_outcomes(eval_paths) if eval_paths else {}
        kinds: dict[str, set[str]] = {}
        for run in runs:
            kinds.setdefault(arm_of(run["name"]), set()).update(_run_members(run))
        for run, members in outcomes.items():
            kinds.setdefault(arm_of(run), set()).update(members)
        single, pops = split_arms(kinds, args.single, args.population)
        dyn_arms = group_arms(runs)
        claims = []
        dyn_pops = [p for p in pops if p in dyn_arms]
        if single in dyn_arms and dyn_pops:
            claims += dynamics_claims(runs, single, dyn_pops, args.window)
        if outcomes:
            claims += benchmark_claims(outcomes, single, pops)
        claims = [judge(c, args.alpha) for c in claims]
        arms_seen = group_arms(runs)
        inputs = [
            "Runs: "
            + "; ".join(f"{arm} ({', '.join(r['name'] for r in rs)})" for arm, rs in arms_seen.items())
            + f". Single agent: {single}; population{'s' if len(pops) > 1 else ''}: {', '.join(pops)}.",
            "Evaluated seeds: "
            + (
                "; ".join(
                    f"{arm} ({', '.join(sorted(r for r in outcomes if arm_of(r) == arm))})"
                    for arm in dict.fromkeys(arm_of(r) for r in sorted(outcomes))
                )
                if outcomes
                else "none (no results.json found)"
            )
            + ".",
        ]
        text = markdown(claims, compute_table(runs), inputs=inputs, alpha=args.alpha)
    except (OSError, ValueError) as e:
        print(f"claims: error: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
