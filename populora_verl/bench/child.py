"""Side-by-side measurements in fresh processes: the order of the settings, and one result line per child.

A fresh process per measurement keeps imports, caches and Ray clusters of one setting out of the next one's time;
the child prints one marked JSON line, the parent reads it back.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["alternating", "rounds", "report", "run"]

T = TypeVar("T")


def alternating(settings: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, setting): the settings forward in even rounds and backward in odd ones, so that a drift of the
    machine's load falls on every setting alike."""
    for r in range(rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            yield r, setting


def rounds(
    settings: Sequence[T], n: int, measure: Callable[[T], dict[str, Any]], line: Callable[[T, dict[str, Any]], str]
) -> tuple[dict[T, list[dict[str, Any]]], tuple[float, float]]:
    """Measure every setting ``n`` times in :func:`alternating` order, printing ``round R <line>`` after each; the
    measurements per setting, and the machine's 1-minute load average before and after."""
    samples: dict[T, list[dict[str, Any]]] = {s: [] for s in settings}
    before = os.getloadavg()[0]
    for r, setting in alternating(settings, n):
        t = measure(setting)
        samples[setting].append(t)
        print(f"round {r + 1} {line(setting, t)}", flush=True)
    return samples, (before, os.getloadavg()[0])


def report(marker: str, values: dict[str, Any]) -> None:
    """In the child: the result line the parent looks for (anything else on stdout is ignored)."""
    print(marker + json.dumps(values), flush=True)


def run(
    cmd: Sequence[str], *, marker: str, what: str, env: dict[str, str] | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run the child; its last result line, or RuntimeError naming ``what`` with the end of its output."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed with exit status {proc.returncode}:\n{(proc.stderr or proc.stdout)[-3000:]}")
    return json.loads(lines[-1][len(marker) :])
