"""The data the population step hands to and takes from an engine, and its per-proposal record.

Plain dataclasses without behaviour, so that :mod:`.orchestration` (the step), :mod:`.metrics` (what it logs) and
the engines (the CPU driver, the verl trainer) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TEACHER",
    "STUDENT",
    "SEED",
    "BASE_POLICY",
    "GenRequest",
    "GenResponse",
    "Sample",
    "TeacherRecord",
    "StepResult",
]

TEACHER = "teacher"
STUDENT = "student"
SEED = "seed"
#: ``GenRequest.adapter`` of the seeding phase: the base model without any adapter. The CPU driver runs it with
#: PEFT's ``__base__``; verl serves it under a fresh member's LoRA id (``lora_B`` is zero before step 1, so the
#: adapter adds nothing).
BASE_POLICY = "__base__"


@dataclass
class GenRequest:
    """One prompt for one adapter, to be sampled ``n`` times. ``meta`` is the orchestration's bookkeeping."""

    adapter: str  # member id
    role: str  # teacher | student
    task_type: str
    prompt: Any  # str, or chat messages (list of {role, content}) when tasks.prompt_template=chat
    n: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenResponse:
    """The ``n`` completions of one request. ``lengths``: response tokens per completion (token-mean whitening,
    as verl; ``None`` counts each completion as one token). ``extra``: engine data per completion (token ids),
    handed back untouched in :attr:`Sample.extra`."""

    request: GenRequest
    texts: list[str]
    lengths: list[int] | None = None
    extra: list[Any] | None = None


@dataclass
class Sample:
    """One trajectory for one adapter's update: reward on the last token, scalar TRR++ advantage."""

    adapter: str
    role: str
    task_type: str
    prompt: Any
    response: str
    reward: float
    advantage: float = 0.0
    length: int = 1
    extra: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class TeacherRecord:
    """One proposal after validation: what the teacher wrote, what became of it, and how its matched students did.
    A valid program under a failed envelope has a ``task`` and the status ``format_error`` (AZR: a task for the
    students, -1 for the teacher)."""

    adapter: str  # the teacher's member id
    task_type: str
    prompt: Any
    response: str
    length: int  # response tokens
    extra: Any  # the engine's data for this completion, handed on to the teacher's sample
    task: Any  # populora_verl.tasks.Task, or None when the proposal gave no task
    status: str  # valid | invalid | format_error
    code: str = ""  # why it gave no task (populora_verl.tasks.verify.FAILURE_CODES); "" when it gave one
    solve: dict[str, list[bool]] = field(default_factory=dict)  # matched student id -> correctness per answer

    @property
    def has_task(self) -> bool:
        return self.task is not None


@dataclass
class StepResult:
    step: int
    samples: list[Sample]  # every scored trajectory, teachers then students
    updates: dict[str, list[Sample]]  # member id -> the samples its update trains on
    metrics: dict[str, float]
    solve_rates: dict[tuple[str, str], float]  # (teacher, student) -> mean correctness on the teacher's tasks
    outcomes: dict[tuple[str, str], list[str]]  # rating games applied per pair
