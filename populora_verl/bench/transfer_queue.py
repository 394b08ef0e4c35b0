"""TransferQueue's start and one step's data round trip against the number of storage units, side by side.

    python -m populora_verl.bench.transfer_queue [--units 8 2 1] [--rounds 2] [--samples 1200] [--tokens 2048]

verl starts TransferQueue (``tq.init``: a controller and ``transfer_queue.backend.SimpleStorage.
num_data_storage_units`` storage actors) in the task runner before the trainer exists, and every step's batch goes
through it. Each measurement runs in a fresh process with its own local Ray cluster: the time of ``tq.init``, then
one ``kv_batch_put`` and one ``kv_batch_get`` of a batch shaped like a step's (token ids, attention mask, old
log-probs and advantages for ``--samples`` sequences of ``--tokens``). The settings alternate between rounds.
Prints every measurement, then median and range per setting, the ratio to the first, and the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from populora_verl.bench import child

__all__ = ["run_child", "summarise", "main"]

_RESULT = "TQ_RESULT "


def run_child(units: int, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh process: ``init_s``, ``put_s``, ``get_s`` and the batch's ``mb``."""
    cmd = [
        sys.executable,
        "-m",
        "populora_verl.bench.transfer_queue",
        "--child",
        "--units",
        str(units),
        "--samples",
        str(args.samples),
        "--tokens",
        str(args.tokens),
    ]
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    return child.run(
        cmd, marker=_RESULT, what=f"TransferQueue with {units} storage unit(s)", env=env, timeout=args.timeout_s
    )


def _child(units: int, samples: int, tokens: int) -> int:
    import ray
    import torch
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    ray.init(num_cpus=max(16, units + 4), include_dashboard=False, log_to_driver=False)
    import transfer_queue as tq

    conf = OmegaConf.create(
        {"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": units}}}
    )
    t0 = time.perf_counter()
    tq.init(conf)
    t1 = time.perf_counter()
    batch = TensorDict(
        {
            "input_ids": torch.randint(0, 150_000, (samples, tokens)),
            "attention_mask": torch.ones(samples, tokens, dtype=torch.int64),
            "old_log_probs": torch.randn(samples, tokens),
            "advantages": torch.randn(samples, tokens),
        },
        batch_size=[samples],
    )
    keys = [f"s{i}" for i in range(samples)]
    t2 = time.perf_counter()
    tq.kv_batch_put(keys=keys, partition_id="bench", fields=batch)
    t3 = time.perf_counter()
    got = tq.kv_batch_get(keys=keys, partition_id="bench")
    t4 = time.perf_counter()
    if len(got["input_ids"]) != samples:  # a short read would make the timing meaningless
        raise RuntimeError(f"read back {len(got['input_ids'])} of {samples} samples")
    mb = sum(v.numel() * v.element_size() for v in batch.values()) / 1e6
    child.report(_RESULT, {"init_s": t1 - t0, "put_s": t3 - t2, "get_s": t4 - t3, "mb": mb})
    tq.close()
    ray.shutdown()
    return 0


def summarise(times: dict[int, list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per setting (in the given order, the first the reference): medians and ranges of init and round trip."""
    rows = []
    ref = None
    for units, ts in times.items():
        init = [t["init_s"] for t in ts]
        trip = [t["put_s"] + t["get_s"] for t in ts]
        row = {
            "units": units,
            "n": len(ts),
            "init_s": statistics.median(init),
            "init_min": min(init),
            "init_max": max(init),
            "trip_s": statistics.median(trip),
            "trip_min": min(trip),
            "trip_max": max(trip),
        }
        ref = ref or row
        row["init_ratio"] = row["init_s"] / ref["init_s"]
        row["trip_ratio"] = row["trip_s"] / ref["trip_s"]
        rows.append(row)
    return rows


def main(
    argv: Sequence[str] | None = None, measure: Callable[[int, argparse.Namespace], dict[str, float]] = run_child
) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.bench.transfer_queue", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--units",
        type=int,
        nargs="+",
        default=[8, 2, 1],
        help="storage-unit counts to compare; the first is the reference (default: verl's 8, "
        "TransferQueue's own 2, and 1)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1200, help="sequences in the batch")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per measurement")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.units[0], args.samples, args.tokens)
    if (
        args.rounds < 1
        or args.samples < 1
        or args.tokens < 1
        or any(u < 1 for u in args.units)
        or len(set(args.units)) != len(args.units)
    ):
        ap.error("--rounds, --samples, --tokens and --units must be at least 1, and the unit counts distinct")
    times: dict[int, list[dict[str, float]]] = {u: [] for u in args.units}
    load_before = os.getloadavg()
    for r, units in child.alternating(args.units, args.rounds):
        t = measure(units, args)
        times[units].append(t)
        print(
            f"round {r + 1}, {units} unit(s): init {t['init_s']:.1f} s, put {t['put_s']:.2f} s, "
            f"get {t['get_s']:.2f} s ({t['mb']:.0f} MB)",
            flush=True,
        )
    load_after = os.getloadavg()
    print(
        f"\n{args.samples} x {args.tokens} tokens; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; {args.rounds} rounds, order alternating\n"
    )
    print(
        f"| storage units | init s (min-max) | put + get s (min-max) | init × {args.units[0]} | "
        f"put + get × {args.units[0]} |"
    )
    print("|---|---|---|---|---|")
    for row in summarise(times):
        print(
            f"| {row['units']} | {row['init_s']:.1f} ({row['init_min']:.1f}-{row['init_max']:.1f}) | "
            f"{row['trip_s']:.2f} ({row['trip_min']:.2f}-{row['trip_max']:.2f}) | {row['init_ratio']:.2f} | "
            f"{row['trip_ratio']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
