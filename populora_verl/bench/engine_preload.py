"""What a process started by ``spawn`` pays for its imports, against one forked from a preloaded forkserver.

The mechanism of ``trainer.populora_engine_preload`` (:mod:`populora_verl.rollout.engine_preload`) without vLLM or a
GPU: in a fresh interpreter per round, start a child that imports ``--modules`` and reports, once with ``spawn``
(vLLM's choice inside a Ray actor) and once from the preloaded forkserver after its imports are done (the early server
waits long enough for that on a GPU host). Arms alternate round by round; the table gives median and spread of the
time from ``Process.start()`` to the child's report, and the ratio::

    python -m populora_verl.bench.engine_preload --modules torch,transformers,verl --rounds 5

What it cannot show: vLLM's own modules (not installed on a CPU machine) and the GPU host's file system, where the
engine core's imports took 21 s (BENCHMARKS.md §5). The trainer's figure comes from ``bench.startup --lever
engine_preload`` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from populora_verl.bench import child

__all__ = ["child_ready", "measure_once", "main"]

#: one round of one arm, in a fresh interpreter: prints {"launch_s": ..., "preload_s": ...}
_DRIVER = """
import json, multiprocessing, sys, time
from populora_verl.bench.engine_preload import child_ready
from populora_verl.rollout import engine_preload as ep
arm, modules = sys.argv[1], sys.argv[2].split(",")
preload_s = 0.0
if arm == "preloaded":
    t = time.perf_counter()
    ep.start(modules)
    ctx = ep.wrap_get_mp_context(lambda: multiprocessing.get_context("spawn"))()
    p = ctx.Process(target=int)  # returns once the forkserver has done its imports
    p.start(); p.join()
    preload_s = time.perf_counter() - t
else:
    ctx = multiprocessing.get_context("spawn")
reader, writer = ctx.Pipe(duplex=False)
t = time.perf_counter()
p = ctx.Process(target=child_ready, args=(modules, writer))
p.start()
writer.close()  # the child holds its own copy: a child that dies before it reports ends recv() with EOFError
reader.recv()
launch_s = time.perf_counter() - t
p.join()
print(json.dumps({"launch_s": launch_s, "preload_s": preload_s, "exitcode": p.exitcode}))
"""


def child_ready(modules: Sequence[str], conn) -> None:
    """The child: import ``modules`` (nothing to do where they were preloaded), then report."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    conn.send(True)


def measure_once(arm: str, modules: Sequence[str], timeout_s: float = 600.0) -> dict:
    """One round of ``arm`` (``spawn`` or ``preloaded``) in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, arm, ",".join(modules)], capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{arm}: the driver failed: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["exitcode"] != 0:
        raise RuntimeError(f"{arm}: the child exited with {out['exitcode']}")
    return out


def _row(name: str, values: list[float]) -> str:
    return f"| {name} | {statistics.median(values):.2f} s | {min(values):.2f}-{max(values):.2f} s |"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default="torch,transformers,verl", help="comma-separated (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per arm, interleaved (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    modules = [m for m in args.modules.split(",") if m]
    started = time.perf_counter()
    samples, _ = child.rounds(
        ("spawn", "preloaded"),
        args.rounds,
        lambda arm: measure_once(arm, modules),
        lambda arm, out: f"{arm}: start() to ready {out['launch_s']:.2f} s",
    )
    launch = {arm: [out["launch_s"] for out in outs] for arm, outs in samples.items()}
    preload = [out["preload_s"] for out in samples["preloaded"]]
    ratio = statistics.median(launch["preloaded"]) / statistics.median(launch["spawn"])
    took = time.perf_counter() - started
    print(f"\nmodules: {', '.join(modules)}; {args.rounds} rounds per arm, interleaved ({took:.0f} s)")
    print("\n| arm | start() to ready, median | min-max |\n|---|---|---|")
    print(_row("spawn", launch["spawn"]))
    print(_row("forked from the preloaded forkserver", launch["preloaded"]))
    print(_row("(the forkserver's own imports, before)", preload))
    print(f"\npreloaded / spawn: {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
