"""Summarise a torch profiler chrome trace (verl's ``global_profiler.tool=torch`` writes ``*.json.gz``) as a short
markdown table, small enough to bring back from the GPU machine where the trace itself is hundreds of MB.

    python -m populora_verl.bench.trace_summary TRACE.json.gz [--top 25] [--out summary.md]

What it answers ("where does one update_actor call spend its time?"):

* the span of each verl stage marker (``user_annotation`` events such as ``update_actor``, ``compute_log_prob``) and
  how much of that span the GPU was busy (union of kernel intervals, so overlapping streams count once);
* the kernels that take the most GPU time (count, total, mean, share of busy time);
* the CPU operators that are called most (count and total inclusive time), which is where launch-bound code shows.

A GPU busy share far below 1 inside ``update_actor`` means the GPU waits for the host (launch or Python overhead,
synchronisations); a share near 1 with small kernels means the micro-batches are too small to fill it.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_events", "busy_time", "summarize", "main"]

_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load_events(path: Path) -> list[dict[str, Any]]:
    """Complete (``ph == "X"``) events of a chrome trace, plain or gzipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", data) if isinstance(data, Mapping) else data
    return [e for e in events if isinstance(e, Mapping) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted ``(start, end)`` intervals covering the same time as ``intervals``."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    return sum(e - s for s, e in _union(intervals))


def _busy_within(union: Sequence[tuple[float, float]], starts: Sequence[float], lo: float, hi: float) -> float:
    """Busy time of a disjoint sorted ``union`` (``starts`` its start times) inside ``[lo, hi]``."""
    i = max(bisect.bisect_right(starts, lo) - 1, 0)  # the interval that may straddle ``lo``
    total = 0.0
    for s, e in union[i : bisect.bisect_left(starts, hi)]:
        total += max(0.0, min(e, hi) - max(s, lo))
    return total


def _gpu_intervals(events: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """GPU activity (kernels, copies, memsets) as ``(start, end)`` in µs."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in _GPU_CATS]


def summarize(events: Sequence[Mapping[str, Any]], *, top: int = 25) -> str:
    if not events:
        return "empty trace: no complete events"
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    # the GPU's busy time once, as disjoint intervals: each stage marker below is a bisect into it, not a rescan
    union = _union(_gpu_intervals(events))
    starts = [s for s, _ in union]
    busy = sum(e - s for s, e in union)
    lines = [
        f"trace span {(end - start) / 1e3:.1f} ms; GPU busy {busy / 1e3:.1f} ms "
        f"({busy / max(end - start, 1e-9):.0%} of the span); {len(events)} events",
        "",
    ]

    # verl's stage markers: the span of each and the GPU's busy share inside it
    stages = [e for e in events if e.get("cat") == "user_annotation"]
    if stages:
        lines += ["| stage marker | calls | span ms | GPU busy ms | GPU busy share |", "|---|---|---|---|---|"]
        agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for e in stages:
            s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            a = agg[str(e.get("name"))]
            a[0] += 1
            a[1] += t - s
            a[2] += _busy_within(union, starts, s, t)
        for name, (n, span, busy) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| {name} | {n} | {span / 1e3:.1f} | {busy / 1e3:.1f} | {busy / max(span, 1e-9):.0%} |")
        lines.append("")

    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in _GPU_CATS:
            k = kernels[str(e.get("name"))[:90]]
            k[0] += 1
            k[1] += float(e["dur"])
    if kernels:
        kernel_time = sum(v[1] for v in kernels.values())
        lines += ["| GPU kernel | count | total ms | mean µs | share of kernel time |", "|---|---|---|---|---|"]
        for name, (n, tot) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| `{name}` | {n} | {tot / 1e3:.1f} | {tot / n:.1f} | {tot / kernel_time:.1%} |")
        lines.append("")

    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cpu_op":
            o = ops[str(e.get("name"))[:90]]
            o[0] += 1
            o[1] += float(e["dur"])
    if ops:
        lines += ["| CPU operator (most calls) | calls | total ms (inclusive) |", "|---|---|---|"]
        for name, (n, tot) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| `{name}` | {n} | {tot / 1e3:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="+", help="chrome trace files (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    args = ap.parse_args(argv)
    parts = []
    for t in args.trace:
        try:
            events = load_events(Path(t))
        except (OSError, ValueError, EOFError) as e:
            print(f"trace_summary: cannot read {t}: {e}", file=sys.stderr)
            return 2
        parts.append(f"## {Path(t).name}\n\n{summarize(events, top=args.top)}\n")
    text = "\n".join(parts)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
