"""Reward levels (all values from :class:`RewardsConfig`).

Student (solver) reward: ``correct`` (1) / ``wrong_answer`` (-0.5) / ``format_error`` (-1).
Teacher (proposer) reward:

    r_T = format_error                  if the proposal is badly formatted       (-1)
        = invalid_program               if the program/inputs fail validation    (-1)
        = 1 - s̄   if 0 < s̄ < 1 else Z   (teacher = "one_minus"; Z = zero_learnability_reward, -0.5 or 0)
        = 1 - s̄                         (teacher = "inverse")

where s̄ is the mean correctness of the solver samples on the task. The population step
(:mod:`populora_verl.step.orchestration`) passes the matched students' samples; in the single-agent AZR baseline
the one member is its own student, so the same code passes the proposer's own solver samples.
"""

from __future__ import annotations

from typing import Iterable

from populora_verl.config import RewardsConfig

__all__ = ["learnability", "solve_rate", "student_reward", "teacher_reward"]

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
