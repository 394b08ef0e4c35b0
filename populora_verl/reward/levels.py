"""Reward levels and the driver-side assembly of teacher rewards (all values from :class:`RewardsConfig`).

Student (solver) reward: ``correct`` (1) / ``wrong_answer`` (-0.5) / ``format_error`` (-1).
Teacher (proposer) reward:

    r_T = format_error                  if the proposal is badly formatted       (-1)
        = invalid_program               if the program/inputs fail validation    (-1)
        = 1 - s̄   if 0 < s̄ < 1 else Z   (teacher = "one_minus"; Z = zero_learnability_reward, -0.5 or 0)
        = 1 - s̄                         (teacher = "inverse")

where s̄ is the mean correctness of the solver samples on the task. Who the solvers are is the caller's
choice, which is how one function serves both games: PopuLoRA passes the matched students' samples,
the single-agent AZR baseline passes the proposer's own solver samples (:func:`solvers_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from populora_verl.config import RewardsConfig

__all__ = [
    "TeacherSample",
    "learnability",
    "solve_rate",
    "student_reward",
    "teacher_reward",
    "assemble_teacher_rewards",
    "solvers_for",
]

_STUDENT_STATUSES = ("correct", "wrong", "format_error")
_TEACHER_STATUSES = ("valid", "invalid", "format_error")


def learnability(s_bar: float, cfg: RewardsConfig) -> float:
    """AZR's proposer reward from a solve rate: ``1 - s̄`` inside (0, 1), Z at the extremes (``one_minus``)."""
    if not 0.0 <= s_bar <= 1.0:
        raise ValueError(f"solve rate must be in [0, 1], got {s_bar}")
    if cfg.teacher == "inverse":
        return 1.0 - s_bar
    return 1.0 - s_bar if 0.0 < s_bar < 1.0 else float(cfg.zero_learnability_reward)


def solve_rate(correct: Iterable[bool | float]) -> float:
    """s̄: the mean correctness of the solver samples (a format error counts as 0)."""
    vals = [float(c) for c in correct]
    if not vals:
        raise ValueError("solve rate of a task with no solver samples is undefined")
    return sum(vals) / len(vals)


def student_reward(status: str, cfg: RewardsConfig) -> float:
    if status not in _STUDENT_STATUSES:
        raise ValueError(f"student status must be one of {_STUDENT_STATUSES}, got {status!r}")
    return {"correct": cfg.correct, "wrong": cfg.wrong_answer, "format_error": cfg.format_error}[status]


def teacher_reward(status: str, s_bar: float | None, cfg: RewardsConfig) -> float:
    """One proposal's reward; ``s_bar`` is needed only for a valid proposal."""
    if status not in _TEACHER_STATUSES:
        raise ValueError(f"teacher status must be one of {_TEACHER_STATUSES}, got {status!r}")
    if status == "format_error":
        return float(cfg.format_error)
    if status == "invalid":
        return float(cfg.invalid_program)
    if s_bar is None:
        raise ValueError("a valid proposal needs its solve rate")
    return learnability(s_bar, cfg)


@dataclass(frozen=True)
class TeacherSample:
    """One proposal trajectory as the driver sees it after validation (``task_id`` set iff valid)."""

    status: str
    task_id: str | None = None


def assemble_teacher_rewards(samples: Sequence[TeacherSample], correctness: Mapping[str, Sequence[bool | float]],
                             cfg: RewardsConfig) -> list[float]:
    """Teacher rewards for ``samples`` given each valid task's solver correctness (task id -> samples).

    A valid task missing from ``correctness`` is an error: learnability needs at least one solver sample.
    """
    out: list[float] = []
    for s in samples:
        if s.status == "valid":
            if s.task_id is None or s.task_id not in correctness:
                raise ValueError(f"no solver samples for valid task {s.task_id!r}")
            out.append(teacher_reward("valid", solve_rate(correctness[s.task_id]), cfg))
        else:
            out.append(teacher_reward(s.status, None, cfg))
    return out


def solvers_for(proposer: str, pairs: Iterable[tuple[str, str]], mode: str = "population") -> list[str]:
    """Whose answers estimate s̄ for ``proposer``'s tasks.

    ``population``: the students matched with it in ``pairs`` ((teacher, student) tuples).
    ``single_agent``: the proposer itself (AZR: one model proposes and solves).
    """
    if mode == "single_agent":
        return [proposer]
    if mode != "population":
        raise ValueError(f"mode must be 'population' or 'single_agent', got {mode!r}")
    return [s for t, s in pairs if t == proposer]
