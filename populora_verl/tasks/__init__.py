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

from populora_verl.tasks.buffer import TaskBuffer, TaskBuffers, load_seed_file, save_seed_file
from populora_verl.tasks.parsing import ParseError, check_format, check_program, extract_answer
from populora_verl.tasks.prompts import (proposer_prompt, proposer_request, render_prompt, solver_prompt,
                                         solver_request)
from populora_verl.tasks.task import Task, identity_code_f_task, identity_task, truncate_output
from populora_verl.tasks.verify import (AnswerScore, Proposal, ProposalResult, parse_proposal, score_answer,
                                        validate_proposal, values_equal)

__all__ = [
    "Task", "identity_task", "identity_code_f_task", "truncate_output",
    "TaskBuffer", "TaskBuffers", "load_seed_file", "save_seed_file",
    "ParseError", "check_format", "check_program", "extract_answer",
    "proposer_prompt", "solver_prompt", "render_prompt", "proposer_request", "solver_request",
    "Proposal", "ProposalResult", "AnswerScore", "parse_proposal", "validate_proposal", "score_answer",
    "values_equal",
]
