"""Task buffers: where validated tasks live between steps, and where proposers draw their references.

One :class:`TaskBuffer` per task type (AZR keeps them apart). References for code_i / code_o proposers come from
their own buffer; code_f proposers are shown one program drawn from the union of the code_i and code_o buffers.

Policy (documented in docs/tasks-and-rewards.md):
- **bounded**: at most ``max_programs`` tasks per buffer; adding to a full buffer evicts the *oldest* entry
  (FIFO), seeds included, so the buffer tracks the recent curriculum.
- **de-duplicated** by (task type, normalised program, normalised input); a duplicate is not re-added.
- **admission filter** (``valid_program_filter``): ``all``; ``non_one`` drops tasks every solver sample solved
  (s̄ = 1); ``non_extremes`` also drops s̄ = 0.
- **sampling** is uniform without replacement from a caller's RNG (``numpy.random.Generator`` or
  ``random.Random``), so the same seed gives the same references.
"""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from populora_verl.config import TASK_TYPES, BufferConfig
from populora_verl.tasks.task import Task, identity_code_f_task, identity_task

__all__ = ["TaskBuffer", "TaskBuffers", "load_seed_file", "save_seed_file"]


def _choose(rng: Any, n: int, k: int) -> list[int]:
    """``k`` distinct indices out of ``range(n)`` drawn with ``rng`` (numpy Generator or random.Random)."""
    k = min(k, n)
    if k <= 0:
        return []
    if hasattr(rng, "choice") and hasattr(rng, "integers"):  # numpy.random.Generator
        return [int(i) for i in rng.choice(n, size=k, replace=False)]
    if isinstance(rng, random.Random):
        return rng.sample(range(n), k)
    raise TypeError(f"rng must be a numpy.random.Generator or random.Random, got {type(rng).__name__}")


class TaskBuffer:
    """A bounded, de-duplicated FIFO of tasks of one type."""

    def __init__(self, task_type: str, max_programs: int = 16384) -> None:
        if task_type not in TASK_TYPES:
            raise ValueError(f"unknown task type {task_type!r}")
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.task_type = task_type
        self.max_programs = max_programs
        self._tasks: OrderedDict[tuple[str, str], Task] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self):
        return iter(self._tasks.values())

    def __contains__(self, task: Task) -> bool:
        return task.key() in self._tasks

    @property
    def tasks(self) -> list[Task]:
        return list(self._tasks.values())

    def add(self, task: Task, solve_rate: float | None = None, filter: str = "all") -> bool:
        """Add ``task`` unless it is a duplicate or the admission ``filter`` rejects its solve rate.

        Returns whether it was added.
        """
        if task.type != self.task_type:
            raise ValueError(f"{self.task_type} buffer cannot hold a {task.type} task")
        if solve_rate is not None:
            if filter == "non_one" and solve_rate >= 1.0:
                return False
            if filter == "non_extremes" and (solve_rate >= 1.0 or solve_rate <= 0.0):
                return False
        key = task.key()
        if key in self._tasks:
            return False
        self._tasks[key] = task
        while len(self._tasks) > self.max_programs:
            self._tasks.popitem(last=False)
            self.evicted += 1
        return True

    def sample(self, k: int, rng: Any) -> list[Task]:
        """Up to ``k`` distinct tasks, uniformly, using ``rng``."""
        tasks = self.tasks
        return [tasks[i] for i in _choose(rng, len(tasks), k)]

    def max_new(self, n: int, rng: Any, since_step: int) -> list[Task]:
        """AZR's ``max_new`` solver batch of exactly ``n`` tasks (an empty buffer gives none): the tasks proposed at
        ``step >= since_step`` come first (a uniform sample of them when there are more than ``n``), the rest is
        uniform over the older tasks; a buffer with fewer tasks than ``n`` repeats them (AZR pads its batch)."""
        tasks = self.tasks
        if n <= 0 or not tasks:
            return []
        new = [t for t in tasks if t.step >= since_step]
        old = [t for t in tasks if t.step < since_step]
        out = [new[i] for i in _choose(rng, len(new), n)]
        out += [old[i] for i in _choose(rng, len(old), n - len(out))]
        while len(out) < n:  # fewer distinct tasks than n: draw again from all of them
            out += [tasks[i] for i in _choose(rng, len(tasks), n - len(out))]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "task_type": self.task_type,
            "max_programs": self.max_programs,
            "evicted": self.evicted,
            "tasks": [t.to_dict() for t in self._tasks.values()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("task_type") != self.task_type:
            raise ValueError(f"state is for a {state.get('task_type')!r} buffer, this one holds {self.task_type}")
        self.max_programs = int(state.get("max_programs", self.max_programs))
        self.evicted = int(state.get("evicted", 0))
        self._tasks = OrderedDict()
        for d in state.get("tasks", []):
            t = Task.from_dict(d)
            self._tasks[t.key()] = t


def load_seed_file(path: str | Path) -> list[Task]:
    """Tasks from a JSONL seed file.

    Each line is ``{"program", "input", "output"}`` (a code_i/code_o triplet, used for both) or
    ``{"program", "inputs", "outputs", "message"}`` (a code_f task; optional ``num_visible``, default half).
    A ``type`` field, if present, pins the line to one task type. Seeds are trusted files; they are not run.
    """
    out: list[Task] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict) or "program" not in d:
                    raise ValueError("each line must be an object with a 'program'")
                if "inputs" in d or d.get("type") == "code_f":
                    inputs, outputs = [str(x) for x in d["inputs"]], [str(x) for x in d["outputs"]]
                    out.append(
                        Task(
                            type="code_f",
                            program=d["program"],
                            inputs=inputs,
                            outputs=outputs,
                            message=str(d.get("message", "")),
                            num_visible=int(d.get("num_visible", len(inputs) // 2)),
                            teacher="seed",
                        )
                    )
                else:
                    types = [d["type"]] if "type" in d else ["code_i", "code_o"]
                    for tt in types:
                        out.append(
                            Task(
                                type=tt,
                                program=d["program"],
                                input=str(d["input"]),
                                output=str(d["output"]),
                                teacher="seed",
                            )
                        )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad seed line: {e}") from None
    return out


def save_seed_file(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write ``tasks`` as a seed file :func:`load_seed_file` reads back (``buffer.seed_file``): a code_i/code_o
    triplet once without ``type`` (it seeds both), a code_f task with its pairs, message and ``num_visible``."""
    lines, seen = [], set()
    for t in tasks:
        if t.type == "code_f":
            d = {
                "program": t.program,
                "inputs": list(t.inputs),
                "outputs": list(t.outputs),
                "message": t.message,
                "num_visible": t.num_visible,
            }
        else:
            d = {"program": t.program, "input": t.input, "output": t.output}
        line = json.dumps(d, sort_keys=True)
        if line not in seen:
            seen.add(line)
            lines.append(line)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    tmp.replace(out)
    return out


class TaskBuffers:
    """The three per-type buffers, seeded, with one ``state_dict`` for checkpoints (``buffers.json``)."""

    def __init__(self, cfg: BufferConfig | None = None, types: Sequence[str] = TASK_TYPES) -> None:
        self.cfg = cfg or BufferConfig()
        self.buffers = {t: TaskBuffer(t, self.cfg.max_programs) for t in types}
        # A seed file another run is still writing (buffer.seed_file_wait_s): read at the first step, not now.
        self.pending_seed_file: str | None = None
        if self.cfg.seed_file and self.cfg.seed_file_wait_s > 0 and not Path(self.cfg.seed_file).exists():
            self.pending_seed_file = str(self.cfg.seed_file)
        else:
            self.seed()

    def await_seed_file(self, poll_s: float = 2.0) -> int:
        """Block until the pending seed file exists (``buffer.seed_file_wait_s`` at most), then seed from it;
        returns the number of seed tasks (0 when nothing was pending)."""
        path = self.pending_seed_file
        if path is None:
            return 0
        deadline = time.monotonic() + self.cfg.seed_file_wait_s
        while not Path(path).exists():
            if time.monotonic() >= deadline:
                raise FileNotFoundError(
                    f"populora.buffer.seed_file: {path} did not appear within "
                    f"{self.cfg.seed_file_wait_s:g} s (populora.buffer.seed_file_wait_s)"
                )
            time.sleep(poll_s)
        tasks = load_seed_file(path)  # written atomically by save_seed_file: complete once it exists
        self.seed(tasks)
        self.pending_seed_file = None
        return len(tasks)

    def seed(self, tasks: Iterable[Task] | None = None) -> None:
        """Fill with ``tasks``, else with the seed file, else with AZR's identity seeds."""
        if tasks is None:
            tasks = (
                load_seed_file(self.cfg.seed_file)
                if self.cfg.seed_file
                else [identity_task("code_i"), identity_task("code_o"), identity_code_f_task()]
            )
        for t in tasks:
            if t.type in self.buffers:
                self.buffers[t.type].add(t)
        # code_f needs programs from the io buffers; a code_f-only run still needs one to draw from.
        if "code_f" in self.buffers and not any(k in self.buffers for k in ("code_i", "code_o")):
            self._io_fallback = [identity_task("code_o")]
        else:
            self._io_fallback = []

    def __getitem__(self, task_type: str) -> TaskBuffer:
        return self.buffers[task_type]

    def add(self, task: Task, solve_rate: float | None = None) -> bool:
        if task.type not in self.buffers:
            return False
        return self.buffers[task.type].add(task, solve_rate, self.cfg.valid_program_filter)

    def references(self, task_type: str, k: int, rng: Any) -> list[Task]:
        """K reference tasks for a code_i / code_o proposer."""
        return self.buffers[task_type].sample(k, rng)

    def program_pool(self) -> list[Task]:
        """Programs a code_f proposer may be shown: the code_i ∪ code_o buffers, de-duplicated by program."""
        seen: dict[str, Task] = {}
        for t in ("code_i", "code_o"):
            if t in self.buffers:
                for task in self.buffers[t]:
                    seen.setdefault(task.key()[0], task)
        return list(seen.values()) or list(self._io_fallback)

    def sample_program(self, rng: Any) -> Task:
        """One program for a code_f proposer, uniformly from :meth:`program_pool`."""
        pool = self.program_pool()
        if not pool:
            return identity_task("code_o")
        return pool[_choose(rng, len(pool), 1)[0]]

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": {t: b.state_dict() for t, b in self.buffers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending_seed_file = None  # a checkpoint's buffers hold the seeds already
        for t, s in state["buffers"].items():
            if t not in self.buffers:
                self.buffers[t] = TaskBuffer(t, self.cfg.max_programs)
            self.buffers[t].load_state_dict(s)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.state_dict()), encoding="utf-8")

    def load(self, path: str | Path) -> None:
        self.load_state_dict(json.loads(Path(path).read_text(encoding="utf-8")))
