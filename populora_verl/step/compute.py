"""Compute per adapter: what a config plans each adapter to train per step, the start-up check that refuses a plan
that is not matched per adapter, and each step's realised trajectories next to the plan (docs/tasks-and-rewards.md,
"Compute matching"). Pure functions of their arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from populora_verl.config import ConfigError, PopuLoRAConfig
from populora_verl.step.records import Sample

__all__ = [
    "ComputePlan",
    "compute_plan",
    "check_compute_plan",
    "planned_trajectories",
    "realised_compute",
    "compare_to_plan",
    "PLAN_TOLERANCE",
]

#: A step warns when an adapter's realised trajectories are off its plan by more than this share of the plan.
PLAN_TOLERANCE = 0.10


@dataclass(frozen=True)
class ComputePlan:
    """Trained trajectories per adapter and step that a config plans, by role, when every proposal is valid.

    ``teacher``: a teacher's proposals; ``student``: a student's answers over the teachers it meets. The single
    agent plays both halves in one adapter (role ``both``: their sum)."""

    mode: str
    teacher: float
    student: float
    num_teachers: int
    num_students: int

    def of_role(self, role: str) -> float:
        """Planned trajectories of one adapter of ``role`` (``teacher``, ``student`` or ``both``)."""
        if role == "both":
            return self.teacher + self.student
        if role in ("teacher", "student"):
            return getattr(self, role)
        raise ValueError(f"unknown role {role!r}; expected teacher | student | both")

    @property
    def mean(self) -> float:
        """The member mean: the number the single agent's plan is matched with."""
        if self.mode == "single_agent":
            return self.of_role("both")
        nt, ns = self.num_teachers, self.num_students
        return (nt * self.teacher + ns * self.student) / (nt + ns)


def _proposals(cfg: PopuLoRAConfig) -> int:
    r = cfg.rollout
    return r.teacher_n * r.proposals_per_type * len(cfg.tasks.types)


def _matches_per_student(cfg: PopuLoRAConfig) -> float:
    p = cfg.population
    return p.num_teachers * min(cfg.matchmaking.students_per_problem, p.num_students) / p.num_students


def compute_plan(cfg: PopuLoRAConfig) -> ComputePlan:
    """The per-role plan of ``cfg``. Each matched teacher gives a student ``teacher_n x proposals_per_type`` tasks
    per type; each is trained with ``student_n`` estimation answers when ``rewards.train_on_estimation_rollouts``
    (under ``student_mix=fallback`` an invalid proposal's stand-in gets ``buffer_task_n``), plus ``buffer_task_n``
    answers on a ``max_new`` buffer task each under ``student_mix=max_new``."""
    r, rw = cfg.rollout, cfg.rewards
    proposals = _proposals(cfg)
    per_task = r.student_n if rw.train_on_estimation_rollouts else 0
    if cfg.buffer.student_mix == "max_new":
        per_task += r.buffer_task_n or r.student_n
    if cfg.population.mode == "single_agent":
        return ComputePlan("single_agent", float(proposals), float(proposals * per_task), 1, 1)
    p = cfg.population
    return ComputePlan(
        "population", float(proposals), _matches_per_student(cfg) * proposals * per_task, p.num_teachers, p.num_students
    )


def planned_trajectories(cfg: PopuLoRAConfig) -> float:
    """Trained trajectories per adapter per step that ``cfg`` plans, averaged over members (see
    :func:`compute_plan`). ``azr_single_agent`` is set so that this equals the population recipes' value."""
    return compute_plan(cfg).mean


def check_compute_plan(cfg: PopuLoRAConfig) -> ComputePlan:
    """The plan of ``cfg`` if every adapter of a role trains the same number of trajectories on every step,
    whatever the proposals' validity and the matches; otherwise :class:`ConfigError` with one line naming the keys
    to change. The start-up of the verl trainer and of the CPU driver call it."""
    r, rw, b = cfg.rollout, cfg.rewards, cfg.buffer
    proposals = _proposals(cfg)
    if cfg.tasks.probabilities is not None:
        raise ConfigError(
            "populora.tasks.probabilities: task types drawn each step change a student's batch (one "
            "quota per type drawn) from step to step, so its compute is not planned; set it null "
            "(rollout.proposals_per_type of every type)"
        )
    if b.student_mix == "fallback" and not rw.train_on_estimation_rollouts:
        n_buf = r.buffer_task_n or r.student_n
        raise ConfigError(
            "populora.rewards.train_on_estimation_rollouts: false under populora.buffer.student_mix="
            "fallback trains a student only on the stand-ins for invalid proposals (0 to "
            f"{proposals * n_buf} trajectories per teacher met, set by validity); set it true, or "
            "buffer.student_mix=max_new"
        )
    if b.student_mix == "fallback" and r.buffer_task_n not in (None, r.student_n):
        lo, hi = proposals * r.buffer_task_n, proposals * r.student_n
        raise ConfigError(
            f"populora.rollout.buffer_task_n: {r.buffer_task_n} under populora.buffer.student_mix="
            f"fallback trains a valid task's {r.student_n} answers (rollout.student_n) but a stand-in's "
            f"{r.buffer_task_n}, so a student trains {min(lo, hi)} to {max(lo, hi)} trajectories per "
            "teacher met, set by validity; set it null (= rollout.student_n), or "
            "buffer.student_mix=max_new"
        )
    plan = compute_plan(cfg)
    if cfg.population.mode == "single_agent":
        return plan
    p = cfg.population
    k = min(cfg.matchmaking.students_per_problem, p.num_students)
    if (p.num_teachers * k) % p.num_students:
        per_match = plan.student / _matches_per_student(cfg)
        raise ConfigError(
            f"populora.population.num_students: {p.num_teachers} teacher(s) x {k} student(s) per "
            f"problem = {p.num_teachers * k} matches a step cannot be shared equally by "
            f"{p.num_students} students (some train {per_match:g} trajectories more than others on "
            "every step); make population.num_teachers x matchmaking.students_per_problem a multiple "
            "of population.num_students"
        )
    return plan


def realised_compute(
    updates: Mapping[str, Sequence[Sample]], generated: Mapping[str, int], updates_per_step: int = 1
) -> dict[str, float]:
    """What each adapter was trained on this step (the compute-matching rule, docs/tasks-and-rewards.md):
    ``populora/compute/<member>/{trajectories,tokens,updates,generated}`` and their ``member_mean``.

    trajectories: samples in its update; tokens: their response tokens; updates: optimizer steps (0 when it had
    nothing to train on); generated: every completion sampled with it, estimation-only answers included."""
    out: dict[str, float] = {}
    rows = []
    for m, xs in updates.items():
        row = {
            "trajectories": float(len(xs)),
            "tokens": float(sum(max(1, s.length) for s in xs)),
            "updates": float(updates_per_step if xs else 0),
            "generated": float(generated.get(m, 0)),
        }
        rows.append(row)
        out.update({f"populora/compute/{m}/{k}": v for k, v in row.items()})
    for k in ("trajectories", "tokens", "updates", "generated"):
        out[f"populora/compute/member_mean/{k}"] = float(np.mean([r[k] for r in rows])) if rows else 0.0
    return out


def compare_to_plan(
    plan: ComputePlan,
    roles: Mapping[str, str],
    updates: Mapping[str, Sequence[Sample]],
    tolerance: float = PLAN_TOLERANCE,
) -> tuple[dict[str, float], str | None]:
    """Each adapter's planned and realised trained trajectories this step, ``populora/compute/<id>/{planned,
    realised}``, and ``populora/compute/max_plan_deviation`` (the largest ``|realised / planned - 1|``; 1 for an
    adapter that trained with nothing planned); plus one warning line naming the adapters off the plan by more than
    ``tolerance``, or None. ``roles``: member id -> role, for every adapter of the step."""
    out: dict[str, float] = {}
    off, worst = [], 0.0
    for m, role in roles.items():
        planned, realised = plan.of_role(role), float(len(updates.get(m, ())))
        out[f"populora/compute/{m}/planned"] = planned
        out[f"populora/compute/{m}/realised"] = realised
        dev = abs(realised / planned - 1.0) if planned > 0 else float(realised > 0)
        worst = max(worst, dev)
        if abs(realised - planned) > tolerance * planned:  # not dev > tolerance: 22 of 20 is 10 % on the dot
            off.append(f"{m} {realised:g} (planned {planned:g})")
    out["populora/compute/max_plan_deviation"] = worst
    warning = None
    if off:
        warning = (
            f"trained trajectories off the plan by more than {tolerance:.0%}: "
            + ", ".join(off)
            + " (docs/tasks-and-rewards.md, compute matching)"
        )
    return out, warning
