"""Resident adapters through verl's FSDP engine code on the CPU: one update with each slot's rows packed into its own
micro-batches (the default) against verl's balanced micro-batches (``POPULORA_RESIDENT_MICRO_BATCHES=verl``).

The model is the tiny Qwen2 of ``test_resident_verl_engine.py`` (2 layers, hidden 32, LoRA r8 on every linear), so
the update is all host work: the figures say how many aten ops and device syncs (``_local_scalar_dense``, a GPU
round trip each) one update dispatches, and how long the host takes, which is what a launch-bound GPU trainer pays.
Interleaved rounds after a warm-up; median and min-max per arm::

    python tests/workers/bench_resident_micro_batches.py --slots 16 --rows 96 --rounds 7
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_resident_verl_engine as harness  # noqa: E402

from populora_verl.workers.resident_engine import MICRO_BATCH_ENV  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rows", type=int, default=96, help="rows in the update, spread evenly over the slots")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    with harness.cpu_rank(tempfile.mktemp()):
        harness.SLOTS = args.slots
        slots = sorted(i % args.slots for i in range(args.rows))  # the fused call's layout: grouped by slot
        rows = harness.padded_rows(args.rows, seed=5)
        eng, _ = harness.verl_engine(resident_slots=True)

        def update(arm: str) -> None:
            os.environ[MICRO_BATCH_ENV] = arm
            eng.train_batch(harness.actor_batch(rows, slots, True), loss_function=harness.loss_fn())

        arms = ("slot", "verl")
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; {args.slots} slots, "
              f"{args.rows} rows, {harness.MAX_TOKENS}-token micro-batches")
        for arm in arms:
            update(arm)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                update(arm)
            c = collections.Counter(e.name for e in prof.events())
            ops = sum(v for k, v in c.items() if k.startswith("aten::"))
            print(f"{arm:5s} aten ops per update {ops:7d}   device syncs {c['aten::_local_scalar_dense']:5d}")
        times: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                t0 = time.perf_counter()
                update(arm)
                times[arm].append(time.perf_counter() - t0)
        for arm, v in times.items():
            print(f"{arm:5s} update s: median {statistics.median(v):.3f} (min-max {min(v):.3f}-{max(v):.3f})")
        print(f"slot / verl: {statistics.median(times['slot']) / statistics.median(times['verl']):.2f}")


if __name__ == "__main__":
    main()
