"""Paired comparisons between the arms of a learning run, from ``populora-eval`` results files.

A learning run with several arms (``single-seed1``, ``2t2s-seed1``, ...) evaluates every arm's members in one
``populora-eval`` call per benchmark, each member named ``<arm>[@<step>].<member>``. This module groups the members by
arm (an arm's score on an item is the mean over its living members, so a population counts once, not per member) and
gives paired bootstrap differences over items: every draw resamples the same items for both sides, per benchmark,
and the code average is the mean over the benchmarks present.

    python -m populora_verl.eval.arms eval/humaneval_plus/results.json eval/mbpp_plus/results.json \
        [--pair single-seed1 base] [--pair 2t2s-seed1 single-seed1]

Without ``--pair`` it compares every arm with ``base``. ``--pool NAME=ARM,ARM,...`` adds an arm whose score on an
item is the mean over the named arms (several seeds of one setting), to compare settings rather than single runs:

    python -m populora_verl.eval.arms */results.json --pool 2t2s=2t2s-seed3,2t2s-seed4 \
        --pool single=single-seed3,single-seed4 --pair 2t2s single --pair 2t2s base --pair single base

Results files of several runs can be given together; a member named in two files must have the same outcomes there
(the base model, evaluated greedily in each run, does).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from populora_verl.eval.report import BOOTSTRAP_SAMPLES, _percentile_interval

__all__ = ["arm_of", "load_outcomes", "arm_scores", "pool_arms", "paired_difference", "main"]


def arm_of(member: str) -> str:
    """``single-seed1@51.a0`` -> ``single-seed1``; ``base`` -> ``base``."""
    return member.split(".", 1)[0].split("@", 1)[0]


def load_outcomes(paths: Sequence[str | Path]) -> dict[str, dict[str, np.ndarray]]:
    """{benchmark: {member: 0/1 outcomes per item}} from one or more results files (one benchmark each or several)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for p in paths:
        data = json.loads(Path(p).read_text(encoding="utf-8"))
        for member, per_bench in data.get("scores", {}).items():
            for bench, s in per_bench.items():
                if "outcomes" not in s:
                    raise ValueError(f"{p}: {member}/{bench} has no per-item outcomes (an older results file)")
                outcomes = np.asarray(s["outcomes"], dtype=float)
                seen = out.setdefault(bench, {}).get(member)
                if seen is not None and not np.array_equal(seen, outcomes):
                    raise ValueError(f"{p}: {member}/{bench} differs from the same member in an earlier file")
                out[bench][member] = outcomes
    if not out:
        raise ValueError("no scores in the given results files")
    return out


def arm_scores(outcomes: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """{benchmark: {arm: per-item score, the mean over the arm's members}}."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for bench, members in outcomes.items():
        groups: dict[str, list[np.ndarray]] = {}
        for m, v in members.items():
            groups.setdefault(arm_of(m), []).append(v)
        out[bench] = {a: np.mean(vs, axis=0) for a, vs in groups.items()}
    return out


def pool_arms(
    scores: Mapping[str, Mapping[str, np.ndarray]], name: str, arms: Sequence[str]
) -> dict[str, dict[str, np.ndarray]]:
    """``scores`` with one more arm, ``name``: per item, the mean over ``arms`` (each seed of a setting counts once,
    whatever its number of members). Every benchmark that has all of ``arms`` gets it."""
    if name in {a for s in scores.values() for a in s}:
        raise ValueError(f"--pool {name}: an arm of that name exists already")
    missing = [a for a in arms if not any(a in s for s in scores.values())]
    if missing:
        raise ValueError(f"--pool {name}: no results for {', '.join(missing)}")
    out = {bench: dict(s) for bench, s in scores.items()}
    for bench, s in out.items():
        if all(a in s for a in arms):
            s[name] = np.mean([s[a] for a in arms], axis=0)
    return out


def paired_difference(
    scores: Mapping[str, Mapping[str, np.ndarray]], a: str, b: str, *, draws: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, tuple[float, float, float]]:
    """{column: (a - b, low, high)} in fractions, per benchmark and ``code avg``; 95 % paired percentile bootstrap."""
    rng = np.random.default_rng(seed)
    out: dict[str, tuple[float, float, float]] = {}
    benches = [k for k in scores if a in scores[k] and b in scores[k]]
    if not benches:
        raise ValueError(f"no benchmark has both {a!r} and {b!r}")
    per_bench_draws = []
    for bench in benches:
        d = scores[bench][a] - scores[bench][b]
        idx = rng.integers(0, len(d), (draws, len(d)))
        boot = d[idx].mean(axis=1)
        per_bench_draws.append(boot)
        out[bench] = (float(d.mean()), *_percentile_interval(boot))
    out["code avg"] = (
        float(np.mean([out[b][0] for b in benches])),
        *_percentile_interval(np.mean(per_bench_draws, axis=0)),
    )
    return out


def markdown(scores: Mapping[str, Mapping[str, np.ndarray]], pairs: Sequence[tuple[str, str]]) -> str:
    benches = list(scores)
    head = "| difference (points) | " + " | ".join(benches) + " | code avg |"
    lines = [head, "|---|" + "---|" * (len(benches) + 1)]
    for a, b in pairs:
        d = paired_difference(scores, a, b)
        cells = [
            f"{100 * d[c][0]:+.1f} [{100 * d[c][1]:+.1f}, {100 * d[c][2]:+.1f}]" if c in d else "–"
            for c in [*benches, "code avg"]
        ]
        lines.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    arms = sorted({a for s in scores.values() for a in s})
    lines += ["", "| arm | " + " | ".join(benches) + " |", "|---|" + "---|" * len(benches)]
    for arm in arms:
        lines.append(
            f"| {arm} | "
            + " | ".join(f"{100 * scores[b][arm].mean():.1f}" if arm in scores[b] else "–" for b in benches)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.eval.arms", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="populora-eval results.json files")
    ap.add_argument("--pair", nargs=2, action="append", metavar=("A", "B"), help="report A - B (repeatable)")
    ap.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME=ARM,ARM",
        help="an arm averaging the named arms per item, e.g. several seeds of one setting (repeatable)",
    )
    args = ap.parse_args(argv)
    pools = []
    for spec in args.pool:
        name, sep, members = spec.partition("=")
        arms = [a for a in members.split(",") if a]
        if not sep or not name or not arms:
            ap.error(f"--pool {spec!r}: expected NAME=ARM,ARM,...")
        pools.append((name, arms))
    try:
        scores = arm_scores(load_outcomes(args.results))
        for name, members in pools:
            scores = pool_arms(scores, name, members)
        arms = sorted({a for s in scores.values() for a in s} - {"base"})
        pairs = [tuple(p) for p in args.pair] if args.pair else [(a, "base") for a in arms]
        print(markdown(scores, pairs))
    except (OSError, ValueError) as e:
        print(f"populora-eval arms: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
