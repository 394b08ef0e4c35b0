"""An AZR-style executor for benchmarks only: a pebble process pool that ``exec``s each program in a worker.

What it reproduces of AZR's executor (facts from the paper and its ``python_executor.py``, our own code): a
``pebble.ProcessPool`` of long-lived worker processes, one task per program with a per-task timeout (a worker
that times out is killed and replaced by pebble), the program ``exec``'d into a fresh namespace in the worker,
``f(<inputs>)`` evaluated twice in that one process and rejected when the results differ, then ``repr``,
``str`` and ``pickle`` of the result. No isolation at all: the program runs with the worker's uid, files,
network and parent. Only an address-space rlimit is set in each worker, so that a memory bomb in the bench mix
cannot take the benchmarking host down.

Never use this outside ``populora_verl.bench``.
"""

from __future__ import annotations

import pickle
import resource
from concurrent.futures import TimeoutError as FutureTimeout

__all__ = ["AzrStylePool"]


def _init_worker(memory_mb: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


def _run_twice(program: str, inputs: str) -> tuple[bool, str | None]:
    env: dict = {"__name__": "__main__"}
    try:
        exec(program, env)  # noqa: S102 - the point of this baseline: no isolation
        call = compile(f"f({inputs})", "<input>", "eval")
        first = eval(call, env)  # noqa: S307
        second = eval(call, env)  # noqa: S307
        if first != second:
            return False, None
        text = repr(first)
        str(first)
        pickle.dumps(first)
        return True, text
    except BaseException:  # noqa: BLE001 - SystemExit and friends are results here
        return False, None


class AzrStylePool:
    """``run_many([(program, inputs)]) -> [(ok, output)]`` on a pebble pool with AZR's per-task timeout."""

    def __init__(self, workers: int, timeout_s: float, memory_mb: int = 512) -> None:
        from pebble import ProcessPool  # bench-only dependency (AZR's choice); pip install pebble

        self.timeout_s = timeout_s
        self._pool = ProcessPool(max_workers=workers, initializer=_init_worker, initargs=(memory_mb,))

    def run_many(self, items: list[tuple[str, str]]) -> list[tuple[bool, str | None]]:
        futures = [self._pool.schedule(_run_twice, args=item, timeout=self.timeout_s) for item in items]
        out = []
        for fut in futures:
            try:
                out.append(fut.result())
            except (FutureTimeout, Exception):  # noqa: BLE001 - timeout, worker crash: a failed program
                out.append((False, None))
        return out

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()

    def __enter__(self) -> AzrStylePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
