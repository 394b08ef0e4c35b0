"""Evaluate every arm of a learning run at its own last checkpoint (at most --max-step), one benchmark per GPU.

Used when the arms ended at different steps (an arm that stopped early): the per-arm step is written into the
results next to each member's name (``<arm>@<step>.<member>``), so nobody mistakes it for a same-step comparison.
    python3 scripts/gpu/eval_arms.py /tmp/learn --model /tmp/models/qwen-coder-1.5b --gpus 0,1
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from populora_verl.bench.learning_run import EVAL_BENCHMARKS, arm_adapters, arm_env, checkpoint_steps, eval_cli


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--max-step", type=int)
    ap.add_argument("--data-dir")
    ap.add_argument("--max-new-tokens", type=int, default=768)
    args = ap.parse_args()
    root = Path(args.root)
    adapters = []
    for run in sorted(p for p in root.iterdir() if p.is_dir() and checkpoint_steps(p)):
        steps = [s for s in checkpoint_steps(run) if args.max_step is None or s <= args.max_step]
        if not steps:
            continue
        adapters += arm_adapters(run, steps[-1])
    gpus = args.gpus.split(",")
    procs = []
    for i, bench in enumerate(EVAL_BENCHMARKS.split(",")):
        out = root / "eval" / bench
        out.mkdir(parents=True, exist_ok=True)
        cmd = [*eval_cli(args.model, bench, out, args.data_dir, args.max_new_tokens, 0.6), "--adapters", *adapters]
        (out / "eval_command.txt").write_text(" ".join(cmd) + "\n")
        log = open(out / "eval.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env=arm_env(f"eval_{bench}", root, gpus[i % len(gpus)])))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
