"""What the population step logs: per-step metrics from the step's records and samples, and the TRR++ group size
check behind the start-up warning (compute per adapter: :mod:`populora_verl.step.compute`). Pure functions of their
arguments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from populora_verl.config import PopuLoRAConfig
from populora_verl.diagnostics.metrics import reward_metrics, validity_metrics
from populora_verl.step.compute import (  # noqa: F401  (callers import them from here)
    planned_trajectories,
    realised_compute,
)
from populora_verl.step.records import STUDENT, Sample, TeacherRecord

__all__ = [
    "realised_compute",
    "planned_trajectories",
    "proposal_outcome_metrics",
    "proposal_validity_metrics",
    "sample_metrics",
    "teacher_group_size",
    "small_group_warning",
    "MIN_TEACHER_GROUP",
]


def _valid_counts(records: Sequence[TeacherRecord], key: str) -> dict[str, tuple[int, int]]:
    """{teacher or task type: (proposals that gave a task, proposals)}"""
    counts: dict[str, tuple[int, int]] = {}
    for rec in records:
        v, n = counts.get(getattr(rec, key), (0, 0))
        counts[getattr(rec, key)] = (v + rec.has_task, n + 1)
    return counts


def proposal_validity_metrics(records: Sequence[TeacherRecord]) -> dict[str, float]:
    """AZR's validity (the share of proposals that gave a task) per teacher and their mean
    (:func:`populora_verl.diagnostics.metrics.validity_metrics`), per task type, and the teachers' format error rate."""
    out = validity_metrics(_valid_counts(records, "adapter"))
    for task_type, (v, n) in _valid_counts(records, "task_type").items():
        out[f"populora/task_type/{task_type}/validity"] = v / n
    if records:
        # The envelope is what a weak base model fails first: this rate should fall in the first steps.
        out["populora/role/teacher/format_error_rate"] = float(np.mean([r.status == "format_error" for r in records]))
    return out


def proposal_outcome_metrics(records: Sequence[TeacherRecord]) -> dict[str, float]:
    """Per task type, what became of the proposals: ``format_error_rate`` (the envelope or a block failed; AZR's
    format penalty), ``unformatted_valid_rate`` (a valid program kept under a failed envelope) and
    ``fail/<code>`` (no task, by :data:`~populora_verl.tasks.verify.FAILURE_CODES`), each over the type's proposals.
    Every code is logged every step (0 when absent), so a plot of one code has no gaps."""
    from populora_verl.tasks.verify import FAILURE_CODES

    out: dict[str, float] = {}
    by_type: dict[str, list[TeacherRecord]] = {}
    for rec in records:
        by_type.setdefault(rec.task_type, []).append(rec)
    for tt, recs in by_type.items():
        n = len(recs)
        p = f"populora/task_type/{tt}"
        out[f"{p}/format_error_rate"] = sum(r.status == "format_error" for r in recs) / n
        out[f"{p}/unformatted_valid_rate"] = sum(r.status == "format_error" and r.has_task for r in recs) / n
        for code in FAILURE_CODES:
            out[f"{p}/fail/{code}"] = sum(not r.has_task and r.code == code for r in recs) / n
    return out


def sample_metrics(samples: Sequence[Sample], answer_format_errors: Sequence[bool]) -> dict[str, float]:
    """Rewards per member and role, response lengths per role, student format errors and accuracy."""
    by_member: dict[str, list[float]] = {}
    by_role: dict[str, list[float]] = {}
    lengths: dict[str, list[int]] = {}
    for s in samples:
        by_member.setdefault(s.adapter, []).append(s.reward)
        by_role.setdefault(s.role, []).append(s.reward)
        lengths.setdefault(s.role, []).append(s.length)
    out = reward_metrics(by_member)
    for role, rs in by_role.items():
        out[f"populora/role/{role}/reward_mean"] = float(np.mean(rs))  # not an id: own prefix
    for role, ls in lengths.items():
        out[f"populora/role/{role}/response_length_mean"] = float(np.mean(ls))
    if answer_format_errors:
        out["populora/role/student/format_error_rate"] = float(np.mean(answer_format_errors))
    correct = [s.meta["correct"] for s in samples if s.role == STUDENT]
    if correct:
        out["populora/student/accuracy"] = float(np.mean(correct))
    return out


#: TRR++ whitens each group's rewards; below this many teacher samples a group is mostly all-invalid at the start of
#: a run (identical rewards, advantage 0), and the teachers get no gradient.
MIN_TEACHER_GROUP = 4


def teacher_group_size(cfg: PopuLoRAConfig) -> int:
    """Teacher samples in one TRR++ group (``advantage.group``) per step: a teacher's proposals of one task type
    (``teacher_n x proposals_per_type``), pooled over the teachers when the group key drops the adapter."""
    per_teacher = cfg.rollout.teacher_n * cfg.rollout.proposals_per_type
    if cfg.population.mode == "single_agent" or cfg.advantage.group == "adapter_task_role":
        return per_teacher
    return per_teacher * cfg.population.num_teachers


def small_group_warning(cfg: PopuLoRAConfig) -> str | None:
    """A start-up warning when a teacher's TRR++ group would hold fewer than :data:`MIN_TEACHER_GROUP` samples."""
    n = teacher_group_size(cfg)
    if n >= MIN_TEACHER_GROUP:
        return None
    return (
        f"populora.rollout.proposals_per_type: a teacher's TRR++ group has {n} sample(s) per task type (fewer than "
        f"{MIN_TEACHER_GROUP}); while most proposals are invalid such groups have identical rewards and teachers get "
        "no advantage. Raise proposals_per_type (or teacher_n), or pool teachers with "
        "populora.advantage.group=subpop_task_role"
    )
