"""Turning model text into tasks (proposals) and into scores (answers), through the sandboxed executor.

Model text never runs in this process: programs, inputs and value comparisons all go to the executor
(``populora_verl.executor``; contract in docs/CONTRACTS.md). Malformed text is a result, never an exception.

Statuses: a proposal is ``valid``, ``format_error`` (envelope or required blocks missing) or ``invalid``
(static checks or execution failed); an answer is ``correct``, ``wrong`` or ``format_error``.

As in AZR, the envelope and the program are judged apart (``tasks.keep_unformatted_tasks``, on by default): a
proposal whose ``<think>/<answer>`` envelope fails still yields its task when the program inside is valid. Its status
is ``format_error`` (the teacher gets ``rewards.format_error``), but the task goes to students and buffers, and it
counts as valid in the validity metrics, which count programs, as AZR does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from populora_verl.config import PopuLoRAConfig
from populora_verl.executor.core import literal_problem, safe_text
from populora_verl.reward.levels import student_reward
from populora_verl.tasks import parsing as P
from populora_verl.tasks.task import TRUNCATE_CHARS, Task

__all__ = [
    "ExecutorLike",
    "Proposal",
    "ProposalResult",
    "AnswerScore",
    "parse_proposal",
    "validate_proposal",
    "score_answer",
    "values_equal",
    "banned_names",
    "FAILURE_CODES",
]

#: Why a proposal yields no task, as short codes for per-type metrics (``ProposalResult.code``).
FAILURE_CODES = (
    "too_long",
    "envelope",
    "blocks",
    "input_count",
    "message",
    "program",
    "input",
    "text",
    "execution",
    "output",
    "min_inputs",
    "unparsable",
)


class ExecutorLike(Protocol):
    """What we need from ``populora_verl.executor.Executor``."""

    def run(self, program: str, inputs: str, *, check_determinism: bool | None = None) -> Any: ...

    def run_many(self, jobs: Sequence[tuple[str, str]], *, check_determinism: bool | None = None) -> list[Any]: ...


def banned_names(cfg: PopuLoRAConfig) -> list[str]:
    """The banned list printed in the prompt plus the executor's, without duplicates."""
    return list(dict.fromkeys(list(cfg.tasks.banned_keywords) + list(cfg.executor.banned_modules)))


def _prompt_chars(cfg: PopuLoRAConfig) -> int:
    # Truncation is for prompts only: a task keeps its full outputs and is judged on them.
    return TRUNCATE_CHARS if cfg.executor.truncate_output else 0


def values_equal(executor: ExecutorLike | None, pairs: Sequence[tuple[str, str, bool]]) -> list[bool]:
    """For each ``(gold, pred, pred_is_untrusted)`` decide whether both texts denote the same value.

    Identical text is equal. Otherwise both must be plain-data literals (:func:`~populora_verl.tasks.parsing.
    parse_literal`), read here without running anything, and compared with the builtin ``==`` (AZR's
    semantics: ``1 == 1.0``, sets unordered); an object's own ``__eq__`` can never take part. Anything else
    (a truncated gold, an expression, a call) is unequal. ``executor`` and ``pred_is_untrusted`` are kept
    for callers of the earlier signature: every side is treated as untrusted now.
    """
    out = []
    for gold, pred, _ in pairs:
        if gold == pred:
            out.append(True)
            continue
        ok_g, g = P.parse_literal(gold)
        ok_p, v = P.parse_literal(pred) if ok_g else (False, None)
        try:
            out.append(bool(ok_g and ok_p and g == v))
        except (RecursionError, MemoryError):
            out.append(False)
    return out


def _task_text_problem(*texts: str) -> str | None:
    """A task's text goes into prompts and logs: it must be UTF-8 encodable, without control characters."""
    for text in texts:
        why = P.unsafe_text(text)
        if why:
            return why
    return None


# --- proposals -------------------------------------------------------------------------------------------


@dataclass
class Proposal:
    """The fenced blocks of a proposal, before any check."""

    task_type: str
    program: str = ""
    input: str = ""
    inputs: list[str] = field(default_factory=list)
    message: str = ""


@dataclass
class ProposalResult:
    """``status``: valid | format_error | invalid. ``task`` is set whenever the program is valid, also under a
    failed envelope (``status == "format_error"``, ``envelope`` says why). ``code`` (one of :data:`FAILURE_CODES`)
    says why there is no task; empty when there is one."""

    status: str
    task: Task | None = None
    reason: str = ""
    code: str = ""
    envelope: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reason, str):  # built from model text and program messages, bound for logs
            self.reason = safe_text(self.reason)

    @property
    def valid(self) -> bool:
        """Well formatted and a usable task: the teacher is rewarded by learnability."""
        return self.status == "valid"

    @property
    def has_task(self) -> bool:
        """The program is a usable task (AZR's validity), whatever the envelope."""
        return self.task is not None


class _BlockError(P.ParseError):
    """A required block is missing or short (the envelope itself was fine or was read through)."""

    def __init__(self, reason: str, code: str = "blocks") -> None:
        super().__init__(reason)
        self.code = code


def parse_proposal(
    response: str,
    task_type: str,
    *,
    num_inputs: int = 10,
    think_prefilled: bool = True,
    code_f_rule: str = "azr",
    max_chars: int | None = None,
    envelope_fallback: bool = False,
) -> Proposal:
    """Extract the blocks a proposal must contain; :class:`~populora_verl.tasks.parsing.ParseError` if missing.

    code_i / code_o: the first python block and the first input block. code_f: the first message block and the
    input blocks: ``code_f_rule="azr"`` needs at least ``num_inputs`` of them and keeps the last ``num_inputs``
    (AZR); ``"lenient"`` keeps the first ``num_inputs``. ``envelope_fallback``: read the blocks through a failed
    envelope (:func:`~populora_verl.tasks.parsing.answer_fallback`) instead of raising.
    """
    try:
        answer = P.extract_answer(response, think_prefilled, max_chars=max_chars)
    except P.ParseError:
        if not envelope_fallback:
            raise
        answer = P.answer_fallback(response, think_prefilled, max_chars=max_chars)
    return _proposal_blocks(answer, task_type, num_inputs=num_inputs, code_f_rule=code_f_rule)


def _proposal_blocks(answer: str, task_type: str, *, num_inputs: int, code_f_rule: str) -> Proposal:
    if task_type in ("code_i", "code_o"):
        program = P.first_block(answer, ("python", "py"))
        inp = P.first_block(answer, ("input",))
        if program is None or not program.strip():
            raise _BlockError("no python block")
        if inp is None or not inp.strip():
            raise _BlockError("no input block")
        return Proposal(task_type=task_type, program=program, input=inp.strip())
    if task_type == "code_f":
        inputs = [b.strip() for tag, b in P.fenced_blocks(answer) if tag == "input" and b.strip()]
        if code_f_rule == "azr":
            if len(inputs) < num_inputs:
                raise _BlockError(f"{len(inputs)} input blocks, need {num_inputs}", "input_count")
            inputs = inputs[-num_inputs:]
        else:
            inputs = inputs[:num_inputs]
        message = P.first_block(answer, ("message",))
        if not inputs:
            raise _BlockError("no input block")
        if message is None or not message.strip():
            # its own code: a code_f proposal with inputs but no message is a different failure from no blocks
            raise _BlockError("no message block", "message")
        return Proposal(task_type=task_type, inputs=inputs, message=message.strip())
    raise _BlockError(f"unknown task type {task_type!r}")


# What Python raises on values built from model text (deep nesting, huge literals, ints past the int-to-str
# digit limit, unencodable strings): a verdict on that text, never an error of the caller.
_TEXT_ERRORS = (RecursionError, MemoryError, UnicodeError, ValueError, OverflowError, TypeError)


def _args_key(text: str) -> str:
    # Distinctness of inputs by their values, so "1,2" and "1, 2" count once (inputs are literals). A value
    # whose repr Python refuses (an int past the int-to-str digit limit, written in hex) keeps its own text.
    try:
        return repr(P.literal_args(text))
    except (ValueError, OverflowError, RecursionError, MemoryError):
        return "\0" + text


def validate_proposal(
    response: str,
    task_type: str,
    executor: ExecutorLike,
    cfg: PopuLoRAConfig,
    *,
    program: Task | None = None,
    teacher: str = "",
    step: int = -1,
    think_prefilled: bool = True,
) -> ProposalResult:
    """See :func:`_validate_proposal`; model text never raises out of here (a parser's recursion or memory
    limit on pathological text makes the proposal invalid)."""
    if task_type == "code_f" and program is None:
        raise ValueError("code_f validation needs the buffered program the proposer was shown")
    try:
        return _validate_proposal(
            response,
            task_type,
            executor,
            cfg,
            program=program,
            teacher=teacher,
            step=step,
            think_prefilled=think_prefilled,
        )
    except _TEXT_ERRORS as e:
        return ProposalResult("invalid", reason=f"unparsable: {type(e).__name__}", code="unparsable")


def _validate_proposal(
    response: str,
    task_type: str,
    executor: ExecutorLike,
    cfg: PopuLoRAConfig,
    *,
    program: Task | None = None,
    teacher: str = "",
    step: int = -1,
    think_prefilled: bool = True,
) -> ProposalResult:
    """The envelope and the program, judged apart (AZR): a failed envelope makes the status ``format_error``; under
    ``tasks.keep_unformatted_tasks`` the program is still read (:func:`parse_proposal`'s fallback) and checked, and a
    valid one keeps its task. Without it, a failed envelope ends the check there (no task)."""
    tcfg = cfg.tasks
    limit = tcfg.max_response_chars
    if not isinstance(response, str) or len(response) > limit:
        return ProposalResult(
            "format_error",
            reason=f"response longer than {limit} characters" if isinstance(response, str) else "response is not text",
            code="too_long",
        )
    envelope = P.envelope_problem(response, think_prefilled)
    if envelope is not None and not tcfg.keep_unformatted_tasks:
        return ProposalResult("format_error", reason=f"envelope: {envelope}", code="envelope", envelope=envelope)
    res = _check_program(
        response, task_type, executor, cfg, program=program, teacher=teacher, step=step, think_prefilled=think_prefilled
    )
    if envelope is None:
        return res
    # A failed envelope is a format error whatever the program: the teacher gets rewards.format_error.
    why = f"envelope: {envelope}" + (f"; {res.reason}" if res.reason else "; program valid")
    return ProposalResult("format_error", task=res.task, reason=why, code=res.code, envelope=envelope)


def _check_program(
    response: str,
    task_type: str,
    executor: ExecutorLike,
    cfg: PopuLoRAConfig,
    *,
    program: Task | None = None,
    teacher: str = "",
    step: int = -1,
    think_prefilled: bool = True,
) -> ProposalResult:
    """Parse, statically check and execute a proposal; a valid one becomes a :class:`Task` with gold answers.

    code_i / code_o: the program must pass :func:`~populora_verl.tasks.parsing.check_program` (one top-level
    function, renamed ``f``; no banned names; no ``input(``), its input must be an argument list, and
    ``f(input)`` must run deterministically in the executor; the output (``repr``) is the gold answer, kept
    whole (``executor.truncate_output`` cuts it to 400 characters in prompts only).
    code_f: ``program`` is the buffered task whose program the proposer saw; each proposed input is run on it.
    ``tasks.code_f_rule=azr``: all ``num_inputs`` inputs must parse and run (deterministically), else the proposal
    is invalid. ``lenient``: valid distinct ones are kept, at least ``tasks.min_valid_inputs`` are needed. The first
    half is shown to the solver, the rest is hidden.
    """
    tcfg = cfg.tasks
    try:
        prop = parse_proposal(
            response,
            task_type,
            num_inputs=tcfg.num_inputs,
            think_prefilled=think_prefilled,
            code_f_rule=tcfg.code_f_rule,
            max_chars=tcfg.max_response_chars,
            envelope_fallback=True,
        )
    except P.ParseError as e:
        return ProposalResult("format_error", reason=str(e), code=getattr(e, "code", "blocks"))

    if task_type in ("code_i", "code_o"):
        checked = None
        try:
            checked = P.check_program(prop.program, banned_names(cfg), max_chars=tcfg.max_program_chars)
            inp = P.check_call_args(prop.input)
            P.literal_args(inp)  # plain data in, plain data out: nothing with its own __eq__ / __repr__
        except P.ParseError as e:
            return ProposalResult("invalid", reason=str(e), code="program" if checked is None else "input")
        why = _task_text_problem(checked.code, inp)
        if why:
            return ProposalResult("invalid", reason=why, code="text")
        res = executor.run(checked.code, inp, check_determinism=cfg.executor.check_determinism)
        if not res.ok or res.output is None:
            return ProposalResult("invalid", reason=f"execution failed: {res.error}", code="execution")
        why = literal_problem(res.output)  # the executor checks it too; a remote or fake one may not
        if why:
            return ProposalResult("invalid", reason=f"output is not plain data: {why}", code="output")
        task = Task(
            type=task_type,
            program=checked.code,
            input=inp,
            output=res.output,
            teacher=teacher,
            step=step,
            prompt_chars=_prompt_chars(cfg),
        )
        return ProposalResult("valid", task=task)

    # code_f
    if program is None:
        raise ValueError("code_f validation needs the buffered program the proposer was shown")
    strict = tcfg.code_f_rule == "azr"
    if _task_text_problem(prop.message):
        return ProposalResult("invalid", reason=f"message: {_task_text_problem(prop.message)}", code="text")
    kept: list[str] = []
    seen: set[str] = set()
    for raw in prop.inputs:
        try:
            inp = P.check_call_args(raw)
            P.literal_args(inp)
        except P.ParseError as e:
            if strict:
                return ProposalResult("invalid", reason=f"input {raw[:40]!r}: {e}", code="input")
            continue
        if _task_text_problem(inp):
            if strict:
                return ProposalResult("invalid", reason=f"input {inp[:40]!r}: {_task_text_problem(inp)}", code="text")
            continue
        key = _args_key(inp)
        if strict or key not in seen:  # AZR keeps repeated inputs; the lenient rule counts each once
            seen.add(key)
            kept.append(inp)
    results = (
        executor.run_many([(program.program, inp) for inp in kept], check_determinism=cfg.executor.check_determinism)
        if kept
        else []
    )
    if strict:
        for inp, r in zip(kept, results):
            if not r.ok or r.output is None:
                return ProposalResult("invalid", reason=f"input {inp[:40]!r} failed: {r.error}", code="execution")
            if literal_problem(r.output) is not None:
                return ProposalResult(
                    "invalid", reason=f"input {inp[:40]!r}: output {literal_problem(r.output)}", code="output"
                )
    pairs = [
        (inp, r.output)
        for inp, r in zip(kept, results)
        if r.ok and r.output is not None and literal_problem(r.output) is None
    ]
    if not strict and len(pairs) < tcfg.min_valid_inputs:
        return ProposalResult(
            "invalid", reason=f"{len(pairs)} valid distinct inputs, need {tcfg.min_valid_inputs}", code="min_inputs"
        )
    task = Task(
        type="code_f",
        program=program.program,
        inputs=[a for a, _ in pairs],
        outputs=[b for _, b in pairs],
        message=prop.message,
        num_visible=len(pairs) // 2,
        teacher=teacher,
        step=step,
        prompt_chars=_prompt_chars(cfg),
    )
    return ProposalResult("valid", task=task)


# --- answers -------------------------------------------------------------------------------------------------


@dataclass
class AnswerScore:
    status: str  # correct | wrong | format_error
    reward: float
    reason: str = ""
    payload: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.reason, str):
            self.reason = safe_text(self.reason)

    @property
    def correct(self) -> bool:
        return self.status == "correct"


def _judge(task: Task, payload: str, executor: ExecutorLike, cfg: PopuLoRAConfig) -> tuple[bool, str]:
    if task.type == "code_o":
        ok = values_equal(executor, [(task.output, payload, True)])[0]
        return ok, "" if ok else "output differs"
    if task.type == "code_i":
        try:
            inp = P.check_call_args(payload)
        except P.ParseError as e:
            return False, str(e)
        try:
            P.literal_args(inp)
        except P.ParseError:
            return False, "input is not made of plain values"
        res = executor.run(task.program, inp)
        if not res.ok or res.output is None:
            return False, f"f(input) failed: {res.error}"
        # The produced output comes from the teacher's program, so it is as trusted as the gold.
        ok = values_equal(executor, [(task.output, res.output, False)])[0]
        return ok, "" if ok else "f(input) differs from the output"
    # code_f: the solver's own function must reproduce every hidden pair.
    try:
        checked = P.check_program(
            payload, banned_names(cfg), max_chars=cfg.tasks.max_program_chars, single_function=False
        )
    except P.ParseError as e:
        return False, str(e)
    hidden = task.hidden_pairs or task.pairs
    if not hidden:
        return False, "task has no I/O pairs to check"
    results = executor.run_many([(checked.code, inp) for inp, _ in hidden])
    if not all(r.ok and r.output is not None for r in results):
        return False, "program failed on a hidden input"
    # The solver's program controls the output text, so it is compared as an untrusted value.
    same = values_equal(executor, [(gold, r.output, True) for (_, gold), r in zip(hidden, results)])
    n_ok = sum(same)
    return n_ok == len(hidden), f"{n_ok}/{len(hidden)} hidden pairs"


def score_answer(
    task: Task, response: str, executor: ExecutorLike, cfg: PopuLoRAConfig, *, think_prefilled: bool = True
) -> AnswerScore:
    """Score a solver response: ``correct`` (``rewards.correct``), ``wrong`` (``rewards.wrong_answer``) or
    ``format_error`` (``rewards.format_error``). Never raises on model text.

    code_o: the predicted output equals the gold by value. code_i: ``f(answer)`` equals the gold output (any
    input that reproduces it counts). code_f: the solver's ``f`` reproduces all hidden pairs (binary).
    """
    try:
        answer = P.extract_answer(response, think_prefilled, max_chars=cfg.tasks.max_response_chars)
        payload = P.extract_solver_payload(answer, task.type)
    except P.ParseError as e:
        return AnswerScore("format_error", student_reward("format_error", cfg.rewards), reason=str(e))
    try:
        ok, why = _judge(task, payload, executor, cfg)
    except _TEXT_ERRORS as e:  # pathological text: a wrong answer, not a crash
        ok, why = False, f"unparsable: {type(e).__name__}"
    status = "correct" if ok else "wrong"
    return AnswerScore(status, student_reward(status, cfg.rewards), reason=why, payload=payload)
