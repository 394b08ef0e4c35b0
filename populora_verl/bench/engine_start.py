"""vLLM engine start-up with its torch.compile cache off and on, side by side.

    python -m populora_verl.bench.engine_start --model DIR [--rounds 3] [--max-loras 8] [--max-lora-rank 64]
        [--gpu-memory-utilization 0.4] [--max-model-len 4096] [--cache-root DIR]

Each round starts one engine per arm, each in a fresh process, in an order that alternates between rounds:

* ``off``: ``VLLM_DISABLE_COMPILE_CACHE=1`` (verl's default), so every start compiles;
* ``on``: ``VLLM_DISABLE_COMPILE_CACHE=0`` (the recipes' setting) with a cache folder of its own that is empty
  before round 1: round 1 compiles and fills it (``on, cold``), later rounds read it (``on, warm``).

The engine has LoRA on with room for a population (``--max-loras``), as the rollout builds it. A start is timed
from the process's launch to the engine being ready, imports included, and split into the import of vLLM and the
engine's construction. Prints every start, then median and range per arm, the ratio to ``off``, and the machine.
Needs a GPU and vLLM; run it on an idle GPU (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from populora_verl.bench import child

__all__ = ["ARMS", "child_env", "run_child", "summarise", "main"]

#: arm -> VLLM_DISABLE_COMPILE_CACHE
ARMS = {"off": "1", "on": "0"}
_RESULT = "ENGINE_START "


def child_env(arm: str, cache_root: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one start: the arm's cache switch, and a cache folder per arm so that ``off`` can neither
    read nor fill the one that ``on`` is measured with."""
    env = dict(os.environ if base is None else base)
    env["VLLM_DISABLE_COMPILE_CACHE"] = ARMS[arm]
    env["VLLM_CACHE_ROOT"] = str(cache_root / arm)
    # vLLM's engine and workers are spawned: a forked CUDA context would break them
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return env


def _engine_args(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        str(args.model),
        "--max-loras",
        str(args.max_loras),
        "--max-lora-rank",
        str(args.max_lora_rank),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--max-model-len",
        str(args.max_model_len),
    ]


def run_child(arm: str, args: argparse.Namespace, cache_root: Path) -> dict[str, float]:
    """Start one engine in a fresh process; its timings (``total_s``, ``import_s``, ``engine_s``)."""
    cmd = [sys.executable, "-m", "populora_verl.bench.engine_start", "--child", *_engine_args(args)]
    start = time.perf_counter()
    timings = child.run(
        cmd, marker=_RESULT, what=f"engine start ({arm})", env=child_env(arm, cache_root), timeout=args.timeout_s
    )
    return {"total_s": time.perf_counter() - start, **timings}


def _child(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from vllm import LLM

    t1 = time.perf_counter()
    LLM(
        model=str(args.model),
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=0,
    )
    t2 = time.perf_counter()
    child.report(_RESULT, {"import_s": t1 - t0, "engine_s": t2 - t1})
    # skip the engine's shutdown: it is not part of a start, and its teardown can take longer than the start
    os._exit(0)


def summarise(starts: list[tuple[int, str, dict[str, float]]]) -> list[dict[str, object]]:
    """Rows ``off``, ``on, cold`` (round 1) and ``on, warm`` (later rounds) from (round, arm, timings) records."""
    groups: dict[str, list[dict[str, float]]] = {"off": [], "on, cold": [], "on, warm": []}
    for rnd, arm, t in starts:
        groups["off" if arm == "off" else ("on, cold" if rnd == 0 else "on, warm")].append(t)
    ref = statistics.median(t["total_s"] for t in groups["off"]) if groups["off"] else None
    rows = []
    for label, ts in groups.items():
        if not ts:
            continue
        totals = [t["total_s"] for t in ts]
        med = statistics.median(totals)
        rows.append(
            {
                "arm": label,
                "n": len(ts),
                "median_s": med,
                "min_s": min(totals),
                "max_s": max(totals),
                "import_s": statistics.median(t["import_s"] for t in ts),
                "engine_s": statistics.median(t["engine_s"] for t in ts),
                "ratio": med / ref if ref else None,
            }
        )
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.bench.engine_start", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", type=Path, required=True, help="a local HF model folder")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of one start per arm (at least 2: round 1 of 'on' is the cold start)",
    )
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-lora-rank", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--cache-root",
        type=Path,
        default=None,
        help="where the arms' cache folders go (default: a temporary folder, removed at the end)",
    )
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per start")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(
    argv: Sequence[str] | None = None, start: Callable[[str, argparse.Namespace, Path], dict[str, float]] = run_child
) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: not a HF model folder (no config.json)")
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (round 1 of 'on' fills the cache, later rounds read it)")
    own_root = args.cache_root is None
    root = Path(tempfile.mkdtemp(prefix="engine-start-cache.")) if own_root else args.cache_root
    for arm in ARMS:
        shutil.rmtree(root / arm, ignore_errors=True)  # 'on, cold' must find an empty cache
    starts: list[tuple[int, str, dict[str, float]]] = []
    load_before = os.getloadavg()
    try:
        for r, arm in child.alternating(list(ARMS), args.rounds):
            t = start(arm, args, root)
            starts.append((r, arm, t))
            print(
                f"round {r + 1} {arm}: {t['total_s']:.1f} s (import {t['import_s']:.1f} s, engine "
                f"{t['engine_s']:.1f} s)",
                flush=True,
            )
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    print(
        f"\n{args.model.name}: LoRA max_loras {args.max_loras}, rank {args.max_lora_rank}; {os.cpu_count()} CPUs; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; GPU "
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'default')}; {args.rounds} rounds, order alternating\n"
    )
    print("| arm | starts | median s | min-max s | import s | engine s | × off |")
    print("|---|---|---|---|---|---|---|")
    for row in summarise(starts):
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "–"
        print(
            f"| {row['arm']} | {row['n']} | {row['median_s']:.1f} | {row['min_s']:.1f}-{row['max_s']:.1f} | "
            f"{row['import_s']:.1f} | {row['engine_s']:.1f} | {ratio} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
