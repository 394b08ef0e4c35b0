"""The paper's dynamics claims, measured from a run's ``metrics.jsonl`` (and verl's ``verl_metrics.jsonl``).

``python -m populora_verl.diagnostics.dynamics RUN [RUN ...] [--out FILE.md]`` prints one markdown section per run:

* learning: AZR validity (valid programs), well-formatted valid proposals, teacher format errors, student accuracy
  and response lengths, first steps against last steps;
* per task type: validity, format errors and why proposals yielded no task (``fail/<code>``);
* complexity of valid teacher programs: least-squares slope per step with a 95 % bootstrap interval (steps
  resampled), the quantity behind "the single agent drifts to easy problems, a population's teachers do not";
* coverage of the CVT archive, pair solve rates with their sign changes (do they oscillate?), ratings;
* realised compute per adapter next to the plan, and the executor's share of the step (validate + score seconds
  over step seconds, from verl's timings).

With ``--compare``, the runs are grouped into arms by their folder names (``2t2s-seed1`` and ``2t2s-seed2`` are the
arm ``2t2s``, as the learning run names them) and a last section sets the arms side by side: the complexity slope
averaged over an arm's seeds with the difference between arms, its 95 % interval over steps and an exact
permutation p over seeds, program length as the obvious confound, coverage next to the number of valid programs
behind it, and pair solve rates' direction changes pooled. Everything is computed from logged numbers; nothing
here is fitted to an expectation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "load_run",
    "slope_interval",
    "sign_changes",
    "summarise",
    "markdown",
    "pair_series",
    "arm_of",
    "group_arms",
    "slope_difference",
    "seed_permutation_p",
    "direction_changes",
    "noise_p_value",
    "compare_arms",
    "compare_markdown",
    "arm_band",
    "plot_arms",
    "main",
]

P = "populora/"
_PAIR = re.compile(r"^populora/pair/([^/]+)/([^/]+)/solve_rate$")
_RATING = re.compile(r"^populora/rating/([^/]+)/mu$")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a killed run (verl's log, evolution.jsonl)
    return rows


def load_run(run: str | Path) -> dict[str, Any]:
    """``{"name", "rows": population metrics by step, "verl": verl metrics by step, "events": evolution events}``."""
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl")
    from populora_verl.diagnostics.metrics import read_metrics

    rows = {int(r["step"]): r for r in read_metrics(run / "metrics.jsonl")}
    verl: dict[int, dict[str, Any]] = {}
    if (run / "verl_metrics.jsonl").is_file():
        for r in _jsonl(run / "verl_metrics.jsonl"):
            if "step" in r:
                verl[int(r["step"])] = r.get("data", r)
    events = _jsonl(run / "evolution.jsonl") if (run / "evolution.jsonl").is_file() else []
    return {"name": run.name, "rows": dict(sorted(rows.items())), "verl": verl, "events": events}


def series(rows: Mapping[int, Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) where ``key`` was logged as a finite number."""
    pts = [
        (s, float(r[key]))
        for s, r in rows.items()
        if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
    ]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s, dtype=float), np.asarray(v, dtype=float)


def slope_interval(
    steps: np.ndarray, values: np.ndarray, *, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float] | None:
    """Least-squares slope per step and its 95 % percentile interval over bootstrap resamples of the points
    (None with fewer than 4 points or one distinct step)."""
    if len(steps) < 4 or np.ptp(steps) == 0:
        return None
    slope = float(np.polyfit(steps, values, 1)[0])
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(draws):
        i = rng.integers(0, len(steps), len(steps))
        if np.ptp(steps[i]) > 0:
            boot.append(np.polyfit(steps[i], values[i], 1)[0])
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return slope, float(lo), float(hi)


def sign_changes(values: Sequence[float]) -> tuple[int, int]:
    """(sign changes of the step-to-step differences, number of non-zero differences): an oscillating series
    changes direction at most steps, a drifting one rarely."""
    d = [b - a for a, b in zip(values, values[1:]) if b != a]
    return sum(1 for a, b in zip(d, d[1:]) if (a > 0) != (b > 0)), len(d)


def pair_series(rows: Mapping[int, Mapping[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``"t0->s1"`` -> (steps, solve rates) for every (teacher, student) pair logged at least once."""
    out = {}
    for k in sorted({k for r in rows.values() for k in r if _PAIR.match(k)}):
        t, st = _PAIR.match(k).groups()
        ps, pv = series(rows, k)
        if len(pv):
            out[f"{t}->{st}"] = (ps, pv)
    return out


def _window(rows: Mapping[int, Mapping[str, Any]], key: str, first: bool, n: int) -> float | None:
    _, v = series(rows, key)
    if len(v) == 0:
        return None
    part = v[:n] if first else v[-n:]
    return float(np.mean(part))


def summarise(run: Mapping[str, Any], window: int = 5) -> dict[str, Any]:
    """The numbers :func:`markdown` prints, as a dict (also what a test or a notebook reads)."""
    rows, verl = run["rows"], run["verl"]
    steps = list(rows)
    out: dict[str, Any] = {"name": run["name"], "steps": len(steps), "last_step": steps[-1] if steps else 0}
    keys = {
        "validity (programs, AZR)": f"{P}validity/mean",
        "teacher format errors": f"{P}role/teacher/format_error_rate",
        "student format errors": f"{P}role/student/format_error_rate",
        "student accuracy": f"{P}student/accuracy",
        "teacher response tokens": f"{P}role/teacher/response_length_mean",
        "student response tokens": f"{P}role/student/response_length_mean",
        "teacher reward": f"{P}role/teacher/reward_mean",
    }
    out["learning"] = {
        label: (_window(rows, k, True, window), _window(rows, k, False, window)) for label, k in keys.items()
    }
    types = sorted(
        {
            m.group(1)
            for r in rows.values()
            for k in r
            for m in [re.match(r"^populora/task_type/([^/]+)/validity$", k)]
            if m
        }
    )
    per_type = {}
    for tt in types:
        base = f"{P}task_type/{tt}"
        fails = {}
        for k in sorted({k for r in rows.values() for k in r if k.startswith(f"{base}/fail/")}):
            _, v = series(rows, k)
            if v.size and v.sum() > 0:
                fails[k.rsplit("/", 1)[1]] = float(np.mean(v))
        per_type[tt] = {
            "validity": (
                _window(rows, f"{base}/validity", True, window),
                _window(rows, f"{base}/validity", False, window),
            ),
            "format errors": (
                _window(rows, f"{base}/format_error_rate", True, window),
                _window(rows, f"{base}/format_error_rate", False, window),
            ),
            "unformatted valid": _window(rows, f"{base}/unformatted_valid_rate", False, len(steps)),
            "no task, by reason (run mean)": fails,
        }
    out["per_type"] = per_type
    s, v = series(rows, f"{P}complexity/cyclomatic/mean")
    out["complexity"] = {
        "points": int(len(v)),
        "first": float(v[:window].mean()) if len(v) else None,
        "last": float(v[-window:].mean()) if len(v) else None,
        "slope": slope_interval(s, v),
    }
    _, cells = series(rows, f"{P}coverage/cells_filled")
    _, wfrac = series(rows, f"{P}coverage/window_fraction")
    out["coverage"] = {
        "cells_filled_last": float(cells[-1]) if len(cells) else None,
        "window_fraction": (
            float(wfrac[:window].mean()) if len(wfrac) else None,
            float(wfrac[-window:].mean()) if len(wfrac) else None,
        ),
    }
    out["pairs"] = {
        pair: {"steps": [int(x) for x in ps], "mean": float(pv.mean()), "sign_changes": sign_changes(list(pv))}
        for pair, (ps, pv) in pair_series(rows).items()
    }
    last = rows[steps[-1]] if steps else {}
    out["ratings"] = {
        m.group(1): (float(last[k]), float(last.get(f"{P}rating/{m.group(1)}/sigma", float("nan"))))
        for k in last
        for m in [_RATING.match(k)]
        if m
    }
    out["events"] = [
        {
            "step": e.get("step"),
            "replacements": [
                f"{r['victim_id']} <- {r['child_id']} = {r['operator']}({', '.join(r['parent_ids'])})"
                + (" [tie-break]" if r.get("tie_break") else "")
                for r in e.get("replacements", [])
            ],
        }
        for e in run["events"]
    ]
    _, real = series(rows, f"{P}compute/member_mean/trajectories")
    _, plan = series(rows, f"{P}compute/planned_trajectories")
    members = sorted(
        {
            k.split("/")[2]
            for r in rows.values()
            for k in r
            if k.startswith(f"{P}compute/") and k.endswith("/trajectories") and "/member_mean/" not in k
        }
    )
    totals = {m: float(series(rows, f"{P}compute/{m}/trajectories")[1].sum()) for m in members}
    _, deviation = series(rows, f"{P}compute/max_plan_deviation")
    # a step on which a member that trained before trains nothing: the matchmaking defect this check was made for
    idle = [st for st, r in rows.items() if any(r.get(f"{P}compute/{m}/trajectories") == 0 for m in members)]
    out["compute"] = {
        "planned_per_step": float(plan[0]) if len(plan) else None,
        "realised_mean_per_step": float(real.mean()) if len(real) else None,
        "per_member_total": totals,
        "steps_with_an_idle_member": idle,
        "steps_off_plan": int((deviation > 0.10).sum()) if len(deviation) else None,
        "max_plan_deviation": float(deviation.max()) if len(deviation) else None,
    }
    step_s = [d.get("timing_s/step") for d in verl.values()]
    execs = [
        (d.get("timing_s/populora_validate", 0.0) + d.get("timing_s/populora_score", 0.0)) / d["timing_s/step"]
        for d in verl.values()
        if d.get("timing_s/step")
    ]
    out["speed"] = {
        "median_step_s": float(np.median([x for x in step_s[1:] if x])) if len(step_s) > 1 else None,
        "executor_share_median": float(np.median(execs[1:])) if len(execs) > 1 else None,
        "executor_share_max": float(np.max(execs[1:])) if len(execs) > 1 else None,
    }
    checks = {}
    for s_, d in verl.items():
        for k, val in d.items():
            if k.endswith("trainer_check/rollout_probs_diff_mean") and k.count("/") == 3:
                member = k.split("/")[1]
                pear = d.get(k.replace("rollout_probs_diff_mean", "rollout_actor_probs_pearson_corr"))
                checks.setdefault(member, []).append((s_, float(val), float(pear) if pear is not None else None))
    out["trainer_check"] = checks
    return out


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown(summary: Mapping[str, Any], window: int = 5) -> str:
    """One run's section."""
    s = summary
    lines = [
        f"### {s['name']} ({s['steps']} logged steps, last step {s['last_step']})",
        "",
        f"| quantity | first {window} steps | last {window} steps |",
        "|---|---|---|",
    ]
    for label, (a, b) in s["learning"].items():
        d = 0 if "tokens" in label else 2
        lines.append(f"| {label} | {_f(a, d)} | {_f(b, d)} |")
    lines += [
        "",
        f"| task type | validity first → last {window} | format errors first → last {window} | "
        "valid under a failed envelope (run mean) | no task, by reason (run mean) |",
        "|---|---|---|---|---|",
    ]
    for tt, d in s["per_type"].items():
        reasons = (
            ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(d["no task, by reason (run mean)"].items(), key=lambda kv: -kv[1])
            )
            or "–"
        )
        lines.append(
            f"| {tt} | {_f(d['validity'][0])} → {_f(d['validity'][1])} | {_f(d['format errors'][0])} → "
            f"{_f(d['format errors'][1])} | {_f(d['unformatted valid'])} | {reasons} |"
        )
    c = s["complexity"]
    slope = c["slope"]
    lines += [
        "",
        f"- complexity (mean cyclomatic of valid teacher programs, {c['points']} steps with one): "
        f"{_f(c['first'])} → {_f(c['last'])}; slope "
        + (f"{slope[0]:+.4f} per step [95% {slope[1]:+.4f}, {slope[2]:+.4f}]" if slope else "– (too few points)"),
    ]
    cov = s["coverage"]
    lines.append(
        f"- coverage: {_f(cov['cells_filled_last'], 0)} CVT cells filled at the end; windowed fraction "
        f"{_f(cov['window_fraction'][0])} → {_f(cov['window_fraction'][1])}"
    )
    for p, d in s["pairs"].items():
        ch, n = d["sign_changes"]
        lines.append(
            f"- pair {p}: solve rate logged at {len(d['steps'])} steps, mean {d['mean']:.2f}, direction "
            f"changed {ch} times in {max(n - 1, 0)} chances"
        )
    if s["ratings"]:
        lines.append(
            "- ratings at the end (mu, sigma): "
            + ", ".join(f"{m} {mu:.1f}/{sg:.1f}" for m, (mu, sg) in sorted(s["ratings"].items()))
        )
    for e in s["events"]:
        lines.append(f"- evolution at step {e['step']}: " + "; ".join(e["replacements"]))
    comp = s["compute"]
    lines.append(
        f"- compute: planned {_f(comp['planned_per_step'], 1)} trained trajectories per adapter and step, "
        f"realised {_f(comp['realised_mean_per_step'], 1)} (member mean); totals per member: "
        + ", ".join(f"{m} {v:.0f}" for m, v in comp["per_member_total"].items())
    )
    off = (
        "per-adapter plan not logged"
        if comp["steps_off_plan"] is None
        else f"{comp['steps_off_plan']} of {s['steps']} steps with an adapter more than 10 % off its plan "
        f"(largest deviation {comp['max_plan_deviation']:.0%})"
    )
    lines.append(
        f"- compute per adapter as realised: {off}; a member trained nothing on "
        f"{len(comp['steps_with_an_idle_member'])} steps"
    )
    sp = s["speed"]
    pct = {k: None if sp[k] is None else 100 * sp[k] for k in ("executor_share_median", "executor_share_max")}
    lines.append(
        f"- speed: median step {_f(sp['median_step_s'], 1)} s; executor (validate + score) "
        f"{_f(pct['executor_share_median'], 1)} % of the step (max {_f(pct['executor_share_max'], 1)} %)"
    )
    for m, pts in sorted(s["trainer_check"].items()):
        lines.append(
            f"- trainer vs vLLM log-probs, {m}: "
            + "; ".join(f"step {st}: mean |Δp| {d:.4f}, Pearson {_f(p, 4)}" for st, d, p in pts)
        )
    return "\n".join(lines) + "\n"


def arm_of(name: str) -> str:
    """``2t2s-seed1`` -> ``2t2s``: the learning run's folders are ``<arm>-seed<N>``; any other name is its own arm."""
    return re.sub(r"-seed\d+$", "", name)


def slope_difference(
    a: Sequence[tuple[np.ndarray, np.ndarray]],
    b: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """Mean per-seed slope of arm ``b`` minus that of arm ``a`` (each a list of (steps, values) per seed), with a 95 %
    percentile interval from resampling every seed's points independently. The interval is over steps only: with two
    seeds per arm it says how sure the slopes are, not how another pair of seeds would fall."""
    runs = [*a, *b]
    if not a or not b or any(len(s) < 4 or np.ptp(s) == 0 for s, _ in runs):
        return None

    def diff(pts: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
        slopes = [float(np.polyfit(s, v, 1)[0]) for s, v in pts]
        return float(np.mean(slopes[len(a) :]) - np.mean(slopes[: len(a)]))

    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(draws):
        pts = []
        for s, v in runs:
            i = rng.integers(0, len(s), len(s))
            pts.append((s[i], v[i]))
        if all(np.ptp(s) > 0 for s, _ in pts):
            boot.append(diff(pts))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return diff(runs), float(lo), float(hi)


def seed_permutation_p(a: Sequence[float | None], b: Sequence[float | None]) -> float | None:
    """Exact two-sided permutation p of mean(b) - mean(a), one value per seed: the share of all ways to relabel the
    pooled seeds into groups of the same sizes whose |difference| is at least the observed one. It asks what
    :func:`slope_difference` cannot, whether another draw of seeds would fall the same way. None below 2 seeds per
    arm; with 2 + 2 seeds the smallest possible p is 1/3, with 4 + 4 it is 1/35."""
    a = [float(x) for x in a if x is not None]
    b = [float(x) for x in b if x is not None]
    if len(a) < 2 or len(b) < 2:
        return None
    pooled = np.array(a + b)
    observed = abs(np.mean(b) - np.mean(a))
    splits = list(itertools.combinations(range(len(pooled)), len(b)))
    hits = 0
    for idx in splits:
        mask = np.zeros(len(pooled), dtype=bool)
        mask[list(idx)] = True
        hits += abs(pooled[mask].mean() - pooled[~mask].mean()) >= observed - 1e-12
    return hits / len(splits)


def direction_changes(values: Sequence[Sequence[float]]) -> tuple[int, int]:
    """(direction changes, chances to change) pooled over several series."""
    counts = [sign_changes(list(v)) for v in values]
    return sum(ch for ch, _ in counts), sum(max(n - 1, 0) for _, n in counts)


def _change_rate(values: Sequence[Sequence[float]]) -> float:
    changes, chances = direction_changes(values)
    return changes / chances if chances else float("nan")


def noise_p_value(values: Sequence[Sequence[float]], *, draws: int = 2000, seed: int = 0) -> float | None:
    """How often the same pair series, each shuffled in time, change direction at a pooled rate (changes per chance)
    at least as high as logged: a one-sided permutation test, None without a chance to change. Shuffling keeps each
    series' own values: solve rates take few distinct values, and a series of few levels changes direction more often
    than continuous noise would (one of two levels alternates at every chance), so the null must keep them."""
    values = [np.asarray(v, dtype=float) for v in values if len(v) >= 3]
    observed = _change_rate(values) if values else float("nan")
    if math.isnan(observed):
        return None
    rng = np.random.default_rng(seed)
    hits = sum(_change_rate([rng.permutation(v) for v in values]) >= observed - 1e-12 for _ in range(draws))
    return hits / draws


def group_arms(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """``{arm: its runs}``, runs grouped by :func:`arm_of` in order of appearance."""
    arms: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        arms.setdefault(arm_of(run["name"]), []).append(run)
    return arms


def compare_arms(runs: Sequence[Mapping[str, Any]], window: int = 5) -> dict[str, Any]:
    """Per arm (:func:`group_arms`): per-seed complexity and length slopes, coverage, valid programs and pooled
    direction changes; and for every later arm, its slope minus the first arm's (``differences``)."""
    arms = group_arms(runs)
    out: dict[str, Any] = {"arms": {}, "differences": {}}
    curves: dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = {}
    for arm, members in arms.items():
        c = curves[arm] = {
            q: [series(r["rows"], f"{P}complexity/{q}/mean") for r in members] for q in ("cyclomatic", "loc")
        }
        rates = [v for r in members for _, v in pair_series(r["rows"]).values()]
        out["arms"][arm] = {
            "seeds": [r["name"] for r in members],
            "cyclomatic_slope": [slope_interval(s, v) for s, v in c["cyclomatic"]],
            "cyclomatic_last": [float(v[-window:].mean()) if len(v) else None for _, v in c["cyclomatic"]],
            "loc_slope": [slope_interval(s, v) for s, v in c["loc"]],
            "cells_filled_last": [
                float(v[-1]) if len(v) else None
                for v in (series(r["rows"], f"{P}coverage/cells_filled")[1] for r in members)
            ],
            "valid_programs": [float(series(r["rows"], f"{P}complexity/num_programs")[1].sum()) for r in members],
            "direction_changes": direction_changes(rates),
            "direction_changes_noise_p": noise_p_value(rates),
        }
    names = list(arms)
    for other in names[1:]:
        diff = {q: slope_difference(curves[names[0]][q], curves[other][q]) for q in ("cyclomatic", "loc")}
        diff["seed_p"] = {
            key: seed_permutation_p(_per_seed(out["arms"][names[0]], key), _per_seed(out["arms"][other], key))
            for key in ("cyclomatic_slope", "loc_slope", "cells_filled_last", "valid_programs")
        }
        out["differences"][f"{other} - {names[0]}"] = diff
    return out


def _per_seed(arm: Mapping[str, Any], key: str) -> list[float | None]:
    """One number per seed: a slope's point estimate (its interval dropped), or the value itself."""
    if key.endswith("_slope"):
        return [None if s is None else s[0] for s in arm[key]]
    return list(arm[key])


def compare_markdown(cmp: Mapping[str, Any], window: int = 5) -> str:
    def slopes(xs: Sequence[tuple[float, float, float] | None]) -> str:
        return "; ".join("–" if x is None else f"{x[0]:+.4f} [{x[1]:+.4f}, {x[2]:+.4f}]" for x in xs)

    def nums(xs: Sequence[float | None], d: int = 2) -> str:
        return ", ".join(_f(x, d) for x in xs)

    lines = [
        "### Arms side by side",
        "",
        "| arm | seeds | cyclomatic slope per step [95%] | cyclomatic, last "
        f"{window} steps | lines-of-code slope per step [95%] | CVT cells at the end | valid programs | "
        "pair direction changes (pooled) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in cmp["arms"].items():
        ch, n = a["direction_changes"]
        lines.append(
            f"| {arm} | {', '.join(a['seeds'])} | {slopes(a['cyclomatic_slope'])} | "
            f"{nums(a['cyclomatic_last'])} | {slopes(a['loc_slope'])} | {nums(a['cells_filled_last'], 0)} | "
            f"{nums(a['valid_programs'], 0)} | {ch} / {n}"
            + (f" ({ch / n:.2f})" if n else "")
            + ("" if a["direction_changes_noise_p"] is None else f", noise p = {a['direction_changes_noise_p']:.3f}")
            + " |"
        )
    for label, d in cmp["differences"].items():
        lines.append("")
        lines.append(
            f"- {label}, slope per step averaged over seeds (95% interval, steps resampled): cyclomatic "
            + slopes([d["cyclomatic"]])
            + "; lines of code "
            + slopes([d["loc"]])
        )
        p = {k: "–" if v is None else f"{v:.2f}" for k, v in d["seed_p"].items()}
        lines.append(
            f"- {label}, across seeds (exact permutation of the seed labels, two-sided): cyclomatic slope "
            f"p = {p['cyclomatic_slope']}, lines-of-code slope p = {p['loc_slope']}, CVT cells p = "
            f"{p['cells_filled_last']}, valid programs p = {p['valid_programs']}"
        )
    lines.append(
        "- Direction changes: a series of independent noise changes direction at about 2 in 3 chances; "
        "noise p is how often the same series, shuffled in time, change direction at least as often per "
        "chance (one-sided; a small p means more regular up-and-down than chance order)."
    )
    return "\n".join(lines) + "\n"


#: What --plot draws, one panel each: (title, metric key).
ARM_PANELS = (
    ("valid programs (AZR's validity)", "populora/validity/mean"),
    ("teacher format errors", "populora/role/teacher/format_error_rate"),
    ("cyclomatic complexity of valid programs", f"{P}complexity/cyclomatic/mean"),
    ("lines of code of valid programs", f"{P}complexity/loc/mean"),
    ("CVT cells filled", f"{P}coverage/cells_filled"),
)


def arm_band(
    runs: Sequence[Mapping[str, Any]], key: str, smooth: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean over seeds, lowest seed, highest seed) of ``key`` for one arm's runs, each seed first averaged
    over a trailing window of ``smooth`` logged steps; a step counts where any seed logged it."""
    per_seed = []
    for r in runs:
        s, v = series(r["rows"], key)
        if smooth > 1 and len(v):
            v = np.array([v[max(0, i - smooth + 1) : i + 1].mean() for i in range(len(v))])
        per_seed.append(dict(zip(s.tolist(), v.tolist())))
    steps = np.array(sorted({s for d in per_seed for s in d}), dtype=float)
    vals = [[d[s] for d in per_seed if s in d] for s in steps.tolist()]
    return (
        steps,
        np.array([np.mean(v) for v in vals]),
        np.array([min(v) for v in vals]),
        np.array([max(v) for v in vals]),
    )


def plot_arms(runs: Sequence[Mapping[str, Any]], out_dir: str | Path, smooth: int = 5) -> Path:
    """``arms.png``: one panel per :data:`ARM_PANELS` quantity, each arm's mean over its seeds (:func:`group_arms`)
    with the range between its seeds shaded; the quantities are smoothed over ``smooth``
    logged steps per seed, since one step holds a few dozen proposals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = group_arms(runs)
    fig, axes = plt.subplots(1, len(ARM_PANELS), figsize=(4.2 * len(ARM_PANELS), 3.4))
    for ax, (title, key) in zip(axes, ARM_PANELS):
        for i, (arm, members) in enumerate(arms.items()):
            steps, mean, lo, hi = arm_band(members, key, smooth)
            if not len(steps):
                continue
            color = f"C{i}"
            ax.plot(steps, mean, color=color, lw=2, label=f"{arm} ({len(members)} seeds)")
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"mean over seeds, range shaded; each seed smoothed over {smooth} steps", fontsize=9)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "arms.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.diagnostics.dynamics", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument(
        "--compare", action="store_true", help="add the arms side by side (runs grouped by folder name: <arm>-seed<N>)"
    )
    ap.add_argument("--plot", metavar="DIR", help="with --compare: draw DIR/arms.png, each arm's mean over its seeds")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be >= 1")
    if args.plot and not args.compare:
        ap.error("--plot needs --compare")
    try:
        runs = [load_run(r) for r in args.runs]
        text = "\n".join(markdown(summarise(r, args.window), args.window) for r in runs)
        if args.compare:
            text += "\n" + compare_markdown(compare_arms(runs, args.window), args.window)
    except FileNotFoundError as e:
        print(f"dynamics: error: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.plot:
        print(f"dynamics: {plot_arms(runs, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
