"""How long verl's task runner takes to have TransferQueue, started by itself (A, verl's order) or by the launching
process beside its start (B, ``trainer.populora_early_transfer_queue``), side by side::

    python -m populora_verl.bench.early_transfer_queue [--rounds 3] [--units 2]

Each round of each arm is a fresh interpreter with its own local Ray cluster doing what ``main_ppo`` does up to the
trainer: (B only: the early start's thread, as the recipes' start-up callback starts it,) ``ray.init``, then a
task-runner actor whose process imports verl's ``main_ppo`` and the plugin's trainer module, as verl's task runner's
process does, and then calls ``tq.init`` with the section. Printed per arm, median and range over the rounds (arms
alternating): from ``ray.init``'s return to the task runner's ``tq.init`` returning, and its ``tq.init`` call alone.
On a GPU host the same phase is the start-up line's "config + TransferQueue" (``bench.startup --lever
early_transfer_queue``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from populora_verl.bench import child

__all__ = ["main"]

_RESULT = "EARLY_TQ_RESULT "
ARMS = ("A", "B")


def _conf(units: int) -> dict:
    return {"enable": True, "backend": {"storage_backend": "SimpleStorage",
                                        "SimpleStorage": {"num_data_storage_units": units}}}  # fmt: skip


def _child(arm: str, units: int) -> int:
    import ray
    from omegaconf import OmegaConf

    from populora_verl.trainer import early_transfer_queue as etq

    early = None
    if arm == "B":
        early = etq.start(OmegaConf.create({"trainer": {"populora_early_transfer_queue": True},
                                            "transfer_queue": _conf(units)}))  # fmt: skip
    # above the physical count: TransferQueue's controller and storage actors deadlock on a 2-CPU Ray budget
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    t0 = time.time()

    @ray.remote
    class TaskRunner:
        def run(self, conf: dict) -> tuple[float, float]:
            import transfer_queue as tq
            import verl.trainer.main_ppo  # noqa: F401 - what verl's task runner process imports
            from omegaconf import OmegaConf

            import populora_verl.trainer.trainer  # noqa: F401 - verl's get_trainer_cls imports it before tq.init

            t1 = time.time()
            tq.init(OmegaConf.create(conf))
            t2 = time.time()
            tq.close()
            return t1, t2

    t1, t2 = ray.get(TaskRunner.remote().run.remote(_conf(units)))
    if early is not None:
        if not early.created:
            raise RuntimeError(f"the early start did not run: {early.error!r}")
        early.finish()
    child.report(_RESULT, {"ready_s": t2 - t0, "init_s": t2 - t1})
    ray.shutdown()
    return 0


def measure(arm: str, units: int, timeout_s: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "populora_verl.bench.early_transfer_queue", "--child", arm, "--units", str(units)]
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    return child.run(cmd, marker=_RESULT, what=f"arm {arm}", env=env, timeout=timeout_s)


def main(argv: Sequence[str] | None = None, measure: Callable[[str, int, float], dict[str, float]] = measure) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.bench.early_transfer_queue", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--units", type=int, default=2, help="storage units (the recipes': 2)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per measurement")
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child, args.units)
    if args.rounds < 1 or args.units < 1:
        ap.error("--rounds and --units must be at least 1")
    times, (load_before, load_after) = child.rounds(
        ARMS,
        args.rounds,
        lambda arm: measure(arm, args.units, args.timeout_s),
        lambda arm, t: f"{arm}: ready {t['ready_s']:.1f} s, tq.init {t['init_s']:.1f} s",
    )
    print(
        f"\n{os.cpu_count()} CPUs; load average {load_before:.2f} before, {load_after:.2f} after; "
        f"{args.rounds} rounds, arms alternating; {args.units} storage units\n"
    )
    print("| arm | ray.init to TransferQueue in the task runner, s (min-max) | its tq.init, s (min-max) | ready × A |")
    print("|---|---|---|---|")
    ref = statistics.median(t["ready_s"] for t in times["A"])
    for arm, what in zip(ARMS, ("A: the task runner starts it", "B: the launching process starts it")):
        ready, init = [t["ready_s"] for t in times[arm]], [t["init_s"] for t in times[arm]]
        print(
            f"| {what} | {statistics.median(ready):.1f} ({min(ready):.1f}-{max(ready):.1f}) | "
            f"{statistics.median(init):.1f} ({min(init):.1f}-{max(init):.1f}) | {statistics.median(ready) / ref:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
