"""The task side of the population step: buffers, prompts, validation and scoring, bound to
:mod:`populora_verl.tasks` and the sandboxed :mod:`populora_verl.executor`.

:class:`~populora_verl.step.orchestration.PopulationStep` talks to this small surface only, so a test can hand it
a fake (``tasks_env=``) and the verl trainer can share one executor across its reward workers.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from populora_verl.config import PopuLoRAConfig

__all__ = ["TaskEnv"]


class TaskEnv:
    """Prompts from buffers, proposal validation and answer scoring for one run."""

    def __init__(self, cfg: PopuLoRAConfig, *, executor: Any = None) -> None:
        from populora_verl.tasks import TaskBuffers

        self.cfg = cfg
        self._executor = executor
        self._owns_executor = executor is None
        self.buffers = TaskBuffers(cfg.buffer, types=tuple(cfg.tasks.types))
        # Both templates open the think block for the model (azr literally, chat by instruction); the parser puts a
        # missing "<think>" back, so one format rule serves both.
        self.think_prefilled = True

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from populora_verl.executor import Executor

            self._executor = Executor.from_config(self.cfg.executor)
        return self._executor

    def close(self) -> None:
        if self._owns_executor and self._executor is not None:
            close = getattr(self._executor, "close", None)
            if close is not None:
                close()
            self._executor = None

    # --- prompts --------------------------------------------------------------------------------------------

    def proposer_request(self, task_type: str, rng: Any) -> tuple[Any, dict[str, Any]]:
        """A proposer prompt (with K buffer references, or one buffered program for code_f) and its meta."""
        from populora_verl.tasks import proposer_prompt, render_prompt

        tcfg = self.cfg.tasks
        if task_type == "code_f":
            program = self.buffers.sample_program(rng)
            question = proposer_prompt(task_type, tcfg, program=program)
            meta = {"program": program, "references": [program.id]}
        else:
            refs = self.buffers.references(task_type, tcfg.num_references, rng) if tcfg.num_references else []
            question = proposer_prompt(task_type, tcfg, references=refs)
            meta = {"program": None, "references": [t.id for t in refs]}
        return render_prompt(question, tcfg.prompt_template, tcfg.templates), meta

    def solver_request(self, task: Any) -> Any:
        from populora_verl.tasks import render_prompt, solver_prompt

        tcfg = self.cfg.tasks
        return render_prompt(solver_prompt(task, tcfg), tcfg.prompt_template, tcfg.templates)

    def buffer_tasks(self, task_type: str, k: int, rng: Any, *, since_step: int | None = None) -> list[Any]:
        """Exactly ``k`` buffer tasks of ``task_type`` for a student (repeated when fewer are buffered): uniform, or
        with ``since_step`` AZR's ``max_new`` batch (tasks proposed at ``step >= since_step`` first)."""
        if k <= 0 or task_type not in self.buffers.buffers:
            return []
        buf = self.buffers[task_type]
        if since_step is not None:
            return buf.max_new(k, rng, since_step)
        out = buf.sample(k, rng)
        while out and len(out) < k:  # fewer tasks than k buffered: repeat them, so every student gets exactly k
            out += buf.sample(k - len(out), rng)
        return out

    # --- checks ---------------------------------------------------------------------------------------------

    def validate_many(
        self, items: Sequence[tuple[str, str, Mapping[str, Any], str, int]]
    ) -> list[tuple[Any, str, str]]:
        """``(task_type, response, meta, teacher, step)`` -> ``(Task | None, status, code)``; status ``valid`` |
        ``format_error`` (envelope or blocks) | ``invalid`` (failed checks or execution); the task is there whenever
        the program is valid, also under a failed envelope (``tasks.keep_unformatted_tasks``); ``code`` says why
        there is none (:data:`~populora_verl.tasks.verify.FAILURE_CODES`). Never raises on model text."""
        from populora_verl.tasks import validate_proposal

        out = []
        for task_type, text, meta, teacher, step in items:
            res = validate_proposal(
                text,
                task_type,
                self.executor,
                self.cfg,
                program=meta.get("program"),
                teacher=teacher,
                step=step,
                think_prefilled=self.think_prefilled,
            )
            out.append((res.task, res.status, res.code))
        return out

    def score_many(self, items: Sequence[tuple[Any, str]]) -> list[tuple[float, bool, str]]:
        """``(task, response)`` -> ``(reward, correct, status)`` (status: correct | wrong | format_error); identical
        answers to one task are scored once."""
        from populora_verl.tasks import score_answer

        cache: dict[tuple[str, str], tuple[float, bool, str]] = {}
        out = []
        for task, text in items:
            key = (task.id, text)
            if key not in cache:
                s = score_answer(task, text, self.executor, self.cfg, think_prefilled=self.think_prefilled)
                cache[key] = (float(s.reward), bool(s.correct), s.status)
            out.append(cache[key])
        return out

    # --- buffers --------------------------------------------------------------------------------------------

    def add_to_buffers(self, tasks: Sequence[tuple[Any, float | None]]) -> int:
        """Add solved valid tasks (with their solve rate, for ``buffer.valid_program_filter``)."""
        return sum(bool(self.buffers.add(task, rate)) for task, rate in tasks)

    def add_seeds(self, tasks: Sequence[Any]) -> list[Any]:
        """Buffer the seeding phase's valid proposals; returns the new ones (duplicates are not).

        A code_i / code_o triplet seeds both io buffers (AZR keeps one io seed set); code_f tasks their own."""
        from dataclasses import replace

        added = []
        for task in tasks:
            types = (
                ["code_f"] if task.type == "code_f" else [t for t in ("code_i", "code_o") if t in self.buffers.buffers]
            )
            new = [self.buffers.add(replace(task, type=t, id="")) for t in types]
            if any(new):
                added.append(task)
        return added

    def await_seed_file(self) -> int:
        """Seed from a seed file another run is still writing (``buffer.seed_file_wait_s``); 0 if none is pending."""
        return self.buffers.await_seed_file()

    def buffers_state(self) -> dict[str, Any]:
        return self.buffers.state_dict()

    def load_buffers_state(self, state: Mapping[str, Any]) -> None:
        self.buffers.load_state_dict(state)
