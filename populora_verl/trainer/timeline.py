"""Where start-up time goes: a few timestamps from the command's start to the end of step 1, printed as one line.

``python -m verl.trainer.main_ppo`` spends minutes before its first step (Ray and the TaskRunner, worker groups
with the FSDP model, the vLLM engines, the checkpoint, the agent loop). The plugin is imported first in the command's
own process, before Ray starts, and records the time in ``POPULORA_START_TIME``; Ray's processes inherit it. The
trainer marks its phases and prints, at the end of step 1:

    [populora] start-up: ray + task runner 41 s | task runner imports 8 s | config + TransferQueue 4 s | workers +
        vLLM 182 s | checkpoint + weight sync 3 s | agent loop 9 s | step 1 48 s | total 295 s

("ray + task runner": from the command to the task runner's process importing verl and the plugin; "task runner
imports": from there until the trainer's module is imported; "config + TransferQueue": from there to the trainer's
construction, which verl's task runner precedes with printing and resolving the config and starting TransferQueue's
actors. Lines printed before this split had one phase for the last two, "task runner setup".)

Diagnostics only: a missing mark or an unset variable shortens the line, never fails a run.
"""

from __future__ import annotations

import os
import re
import time

__all__ = ["START_ENV", "LINE_PREFIX", "record_start", "imported_at", "Timeline", "total_seconds", "parse_line"]

START_ENV = "POPULORA_START_TIME"
LINE_PREFIX = "[populora] start-up: "
_TOTAL = re.compile(re.escape(LINE_PREFIX) + r".*\btotal (\d+(?:\.\d+)?) s")
_PHASE = re.compile(r"^(?P<name>.+?) (?P<sec>-?\d+(?:\.\d+)?) s$")


_IMPORTED_AT: float | None = None


def record_start() -> None:
    """Called at plugin import: the first process to import it (the command itself) sets the start time; every
    process notes when it imported the plugin (in the task runner: when Ray had it up and it imported verl)."""
    global _IMPORTED_AT
    os.environ.setdefault(START_ENV, repr(time.time()))
    if _IMPORTED_AT is None:
        _IMPORTED_AT = time.time()


def imported_at() -> float | None:
    """When this process imported the plugin (None before)."""
    return _IMPORTED_AT


class Timeline:
    """Named marks in order; :meth:`line` gives the time between consecutive marks."""

    def __init__(self, start: float | None = None) -> None:
        if start is None:
            try:
                start = float(os.environ[START_ENV])
            except (KeyError, ValueError):
                start = None
        self.marks: list[tuple[str, float]] = [("start", start)] if start is not None else []

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks.append((name, time.time() if at is None else at))

    def phases(self) -> list[tuple[str, float]]:
        """``(name, seconds since the previous mark)`` for every mark after the first."""
        return [(name, t - prev) for (_, prev), (name, t) in zip(self.marks, self.marks[1:])]

    def line(self) -> str:
        parts = [f"{name} {sec:.0f} s" for name, sec in self.phases()]
        if len(self.marks) >= 2:
            parts.append(f"total {self.marks[-1][1] - self.marks[0][1]:.0f} s")
        return LINE_PREFIX + " | ".join(parts)


def total_seconds(log: str) -> float | None:
    """The ``total`` of the last start-up line in a trainer's log (launch to the end of step 1), if it printed one."""
    found = _TOTAL.findall(log)
    return float(found[-1]) if found else None


def timed(name: str, timing_raw: dict, **kwargs):
    """verl's ``marked_timer`` (a phase's seconds into ``timing_raw``), imported when first used: the trainer's mixin
    modules must not import verl at their own import, because verl's import loads this plugin, which imports the
    trainer and with it those half-loaded modules."""
    from verl.utils.debug import marked_timer

    return marked_timer(name, timing_raw, **kwargs)


def parse_line(log: str) -> dict[str, float] | None:
    """The phases of the last start-up line in ``log`` (a trainer's output), in order, ``total`` last where printed:
    the inverse of :meth:`Timeline.line`. None when the log has no such line."""
    lines = [ln for ln in log.splitlines() if LINE_PREFIX in ln]
    if not lines:
        return None
    phases: dict[str, float] = {}
    for part in lines[-1].split(LINE_PREFIX, 1)[1].strip().split(" | "):
        m = _PHASE.match(part.strip())
        if m:
            phases[m["name"]] = float(m["sec"])
    return phases
