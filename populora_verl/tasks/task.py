"""The :class:`Task` record shared by prompts, validation, scoring, buffers and the reward manager."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from populora_verl.config import TASK_TYPES

__all__ = ["Task", "IDENTITY_PROGRAM", "identity_task", "identity_code_f_task", "truncate_output", "TRUNCATE_CHARS"]

#: AZR's cap on a stored gold output; longer reprs keep their two ends around a "..." marker.
TRUNCATE_CHARS = 400

IDENTITY_PROGRAM = "def f(a):\n    return a\n"


def truncate_output(text: str, limit: int = TRUNCATE_CHARS) -> str:
    """Cut ``text`` to ``limit`` characters, keeping both ends around ``...`` (AZR parity)."""
    if len(text) <= limit:
        return text
    keep = limit - 3
    return text[: (keep + 1) // 2] + "..." + text[len(text) - keep // 2 :]


@dataclass
class Task:
    """One AZR task.

    ``code_i`` / ``code_o``: the triplet ``(program, input, output)`` with ``output = repr(f(input))``.
    ``code_f``: ``program`` plus I/O pairs ``inputs``/``outputs`` and a ``message``; the first ``num_visible``
    pairs are shown to the solver, the rest are hidden and decide correctness.
    ``teacher`` is the member id that proposed it (``"seed"`` for seeds), ``step`` the training step.
    """

    type: str
    program: str
    input: str = ""
    output: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    message: str = ""
    num_visible: int = 0
    teacher: str = ""
    step: int = -1
    id: str = ""
    #: Outputs longer than this are shown middle-truncated in prompts (``executor.truncate_output``, AZR's 400);
    #: 0 shows them whole. Answers are always judged on the full outputs held in ``output``/``outputs``: a
    #: truncated gold would accept any answer whose output shares its two ends.
    prompt_chars: int = 0

    def __post_init__(self) -> None:
        if self.type not in TASK_TYPES:
            raise ValueError(f"Task.type must be one of {list(TASK_TYPES)}, got {self.type!r}")
        if self.type == "code_f":
            if len(self.inputs) != len(self.outputs):
                raise ValueError(
                    f"code_f task needs one output per input, got {len(self.inputs)} inputs and "
                    f"{len(self.outputs)} outputs"
                )
            if not 0 <= self.num_visible <= len(self.inputs):
                raise ValueError(f"num_visible={self.num_visible} outside [0, {len(self.inputs)}]")
        if not self.id:
            self.id = self.fingerprint()

    # --- pairs -----------------------------------------------------------------------------------------
    @property
    def pairs(self) -> list[tuple[str, str]]:
        return list(zip(self.inputs, self.outputs))

    @property
    def visible_pairs(self) -> list[tuple[str, str]]:
        return self.pairs[: self.num_visible]

    def shown(self, output: str) -> str:
        """``output`` as a prompt shows it (see ``prompt_chars``)."""
        return truncate_output(output, self.prompt_chars) if self.prompt_chars else output

    @property
    def hidden_pairs(self) -> list[tuple[str, str]]:
        return self.pairs[self.num_visible :]

    # --- identity --------------------------------------------------------------------------------------
    def key(self) -> tuple[str, str]:
        """De-duplication key: normalised program and input(s)."""
        from populora_verl.tasks.parsing import normalise_program

        inp = "\n".join(i.strip() for i in self.inputs) if self.type == "code_f" else self.input.strip()
        return normalise_program(self.program), inp

    def fingerprint(self) -> str:
        prog, inp = self.key()
        return hashlib.sha1(f"{self.type}\0{prog}\0{inp}".encode()).hexdigest()[:16]

    # --- (de)serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Task:
        if not isinstance(d, Mapping):
            raise ValueError(f"task must be a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown task fields {sorted(unknown)}")
        kw = dict(d)
        for k in ("inputs", "outputs"):
            if k in kw:
                kw[k] = [str(x) for x in kw[k]]
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> Task:
        return cls.from_dict(json.loads(text))


def identity_task(type: str = "code_o") -> Task:
    """AZR's seed triplet: the identity function on ``"Hello world"``."""
    return Task(type=type, program=IDENTITY_PROGRAM, input="'Hello world'", output="'Hello world'", teacher="seed")


# AZR's code_f seed: the identity on six values of different types (str, int, dict, tuple, nested-list string,
# big int). Outputs are the reprs of the inputs, as the executor would produce them.
_CODE_F_SEED_INPUTS = [
    "'Hello world'",
    "1",
    "dict(a=1, b=2)",
    "(1.1, 1.2, 1.3)",
    "'[[1, 0, 0], [0, 0, 0], [0, 0, 0]]'",
    "1001101100010001",
]
_CODE_F_SEED_OUTPUTS = [
    "'Hello world'",
    "1",
    "{'a': 1, 'b': 2}",
    "(1.1, 1.2, 1.3)",
    "'[[1, 0, 0], [0, 0, 0], [0, 0, 0]]'",
    "1001101100010001",
]


def identity_code_f_task() -> Task:
    return Task(
        type="code_f",
        program=IDENTITY_PROGRAM,
        inputs=list(_CODE_F_SEED_INPUTS),
        outputs=list(_CODE_F_SEED_OUTPUTS),
        message="Write a function that returns whatever you input",
        num_visible=len(_CODE_F_SEED_INPUTS) // 2,
        teacher="seed",
    )
