"""Proposer and solver prompts for the three AZR task types, the two prompt templates, and the tokenization both
engines share.

The text comes from :mod:`populora_verl.tasks.templates` (our wording, carrying every requirement AZR's prompts
state), or from ``populora.tasks.prompt_file`` for a run with other wording (AZR's own, for an exact replication).

AZR's code_i and code_o proposer prompts appear to carry each other's difficulty sentence; we write the
sentence that matches the task (code_o: the output is hard to deduce; code_i: the input is hard to recover).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from populora_verl.config import TasksConfig
from populora_verl.tasks.task import Task
from populora_verl.tasks.templates import DEFAULT_TEMPLATES

__all__ = ["proposer_prompt", "solver_prompt", "render_prompt", "proposer_request", "solver_request", "encode_prompt"]


def _templates(cfg: TasksConfig | None) -> Mapping[str, str]:
    return cfg.templates if cfg is not None else DEFAULT_TEMPLATES


def render_prompt(
    question: str, template: str = "azr", templates: Mapping[str, str] | None = None
) -> str | list[dict[str, str]]:
    """``azr``: one plain string ending with ``Assistant: <think>``. ``chat``: a messages list for
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``. ``templates``: ``cfg.tasks.templates``
    (the defaults when None)."""
    t = templates if templates is not None else DEFAULT_TEMPLATES
    if template == "azr":
        return t["azr_wrapper"].format(question=question)
    if template == "chat":
        return [{"role": "user", "content": t["chat_wrapper"].format(question=question)}]
    raise ValueError(f"unknown prompt template {template!r} (expected 'azr' or 'chat')")


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Prompt token ids, the same in every engine (the CPU driver and verl's agent loop both call this).

    ``azr`` prompts are plain text, tokenized as they are: no chat template and no special tokens added, as AZR
    feeds its base models. ``chat`` prompts go through ``tokenizer.apply_chat_template`` with the generation prompt.
    """
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    out = tokenizer.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):  # transformers may return a BatchEncoding
        out = out["input_ids"]
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(i) for i in out]


def _references(refs: Sequence[Task], t: Mapping[str, str]) -> str:
    if not refs:
        return "(none yet)"
    return "\n\n".join(
        t["reference"].format(index=i + 1, program=r.program.rstrip(), input=r.input, output=r.shown(r.output))
        for i, r in enumerate(refs)
    )


def proposer_prompt(
    task_type: str, cfg: TasksConfig, *, references: Sequence[Task] = (), program: Task | None = None
) -> str:
    """The proposer's question text (render it with :func:`render_prompt`).

    code_i / code_o: conditioned on ``references`` (K tasks from the buffer). code_f: on one buffered
    ``program`` for which the proposer writes ``cfg.num_inputs`` inputs and a message.
    """
    t = _templates(cfg)
    banned = ", ".join(cfg.banned_keywords)
    if task_type in ("code_i", "code_o"):
        return t[f"propose_{task_type}"].format(
            references=_references(references, t), banned_keywords=banned, num_references=len(references)
        )
    if task_type == "code_f":
        if program is None:
            raise ValueError("code_f proposer prompt needs the buffered program")
        return t["propose_code_f"].format(
            program=program.program.rstrip(), num_inputs=cfg.num_inputs, banned_keywords=banned
        )
    raise ValueError(f"unknown task type {task_type!r}")


def solver_prompt(task: Task, cfg: TasksConfig | None = None) -> str:
    """The solver's question text for a validated task."""
    t = _templates(cfg)
    if task.type == "code_o":
        return t["solve_code_o"].format(program=task.program.rstrip(), input=task.input)
    if task.type == "code_i":
        return t["solve_code_i"].format(program=task.program.rstrip(), output=task.shown(task.output))
    if task.type == "code_f":
        pairs = "\n\n".join(
            t["pair"].format(index=i + 1, input=a, output=task.shown(b)) for i, (a, b) in enumerate(task.visible_pairs)
        )
        return t["solve_code_f"].format(
            pairs=pairs or "(No examples are shown for this task.)", message=task.message, num_visible=task.num_visible
        )
    raise ValueError(f"unknown task type {task.type!r}")


def proposer_request(
    task_type: str, buffers: Any, cfg: TasksConfig, rng: Any
) -> tuple[str | list[dict[str, str]], Task | None]:
    """A rendered proposer prompt drawn from ``buffers`` (a :class:`~populora_verl.tasks.buffer.TaskBuffers`).

    Returns ``(prompt, program)``: ``program`` is the buffered task shown to a code_f proposer (pass it to
    ``validate_proposal(..., program=program)`` and to the reward manager's ``populora.task``), else ``None``.
    """
    if task_type == "code_f":
        program = buffers.sample_program(rng)
        return render_prompt(
            proposer_prompt("code_f", cfg, program=program), cfg.prompt_template, cfg.templates
        ), program
    refs = buffers.references(task_type, cfg.num_references, rng)
    return render_prompt(proposer_prompt(task_type, cfg, references=refs), cfg.prompt_template, cfg.templates), None


def solver_request(task: Task, cfg: TasksConfig) -> str | list[dict[str, str]]:
    """The rendered solver prompt for a validated task."""
    return render_prompt(solver_prompt(task, cfg), cfg.prompt_template, cfg.templates)
