"""AZR task types (code_o deduction, code_i abduction, code_f induction): prompts, parsing, validation through
the sandboxed executor, scoring, and the task buffers.

Typical flow (driver side)::

    refs = buffers.references("code_o", cfg.tasks.num_references, rng)
    prompt = render_prompt(proposer_prompt("code_o", cfg.tasks, references=refs), cfg.tasks.prompt_template)
    result = validate_proposal(response, "code_o", executor, cfg, teacher="t0", step=step)
    if result.valid:
        buffers.add(result.task)
        student_prompt = render_prompt(solver_prompt(result.task), cfg.tasks.prompt_template)
        score = score_answer(result.task, student_response, executor, cfg)   # score.reward, score.correct
"""

from __future__ import annotations

import importlib

# name -> submodule. Loaded on first use (PEP 562), so that importing one submodule (the config reads
# ``populora_verl.tasks.templates``) does not pull in verify, the executor and the config itself.
_EXPORTS = {
    "Task": "task",
    "identity_task": "task",
    "identity_code_f_task": "task",
    "truncate_output": "task",
    "TaskBuffer": "buffer",
    "TaskBuffers": "buffer",
    "load_seed_file": "buffer",
    "save_seed_file": "buffer",
    "ParseError": "parsing",
    "check_format": "parsing",
    "check_program": "parsing",
    "extract_answer": "parsing",
    "proposer_prompt": "prompts",
    "solver_prompt": "prompts",
    "render_prompt": "prompts",
    "proposer_request": "prompts",
    "solver_request": "prompts",
    "Proposal": "verify",
    "ProposalResult": "verify",
    "AnswerScore": "verify",
    "parse_proposal": "verify",
    "validate_proposal": "verify",
    "score_answer": "verify",
    "values_equal": "verify",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"populora_verl.tasks.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
