"""Proposer and solver prompts for the three AZR task types, and the two prompt templates.

The wording is ours; the information matches AZR's prompts: what to produce, the rules a program must follow
(entry function ``f`` with at least one parameter returning a value, determinism, no randomness / time / I/O /
printing, imports at the top, the banned keywords), the reference tasks, and the fenced-block answer format
inside ``<think>…</think><answer>…</answer>``.

AZR's code_i and code_o proposer prompts appear to carry each other's difficulty sentence; we write the
sentence that matches the task (code_o: the output is hard to deduce; code_i: the input is hard to recover).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from populora_verl.config import TasksConfig
from populora_verl.tasks.task import Task

__all__ = ["proposer_prompt", "solver_prompt", "render_prompt", "proposer_request", "solver_request", "encode_prompt",
           "AZR_PREAMBLE", "CHAT_FORMAT_NOTE"]

AZR_PREAMBLE = (
    "A conversation between User and Assistant. The User asks a question and the Assistant answers it. "
    "The Assistant first reasons about the question step by step, then gives the answer. The reasoning is "
    "written inside <think> </think> tags and the answer inside <answer> </answer> tags, like this: "
    "<think> reasoning here </think> <answer> answer here </answer>."
)

CHAT_FORMAT_NOTE = (
    "Reason step by step inside <think> </think> tags first, then give your final answer inside "
    "<answer> </answer> tags: <think> reasoning here </think> <answer> answer here </answer>."
)


def render_prompt(question: str, template: str = "azr") -> str | list[dict[str, str]]:
    """``azr``: one plain string ending with ``Assistant: <think>``. ``chat``: a messages list for
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``."""
    if template == "azr":
        return f"{AZR_PREAMBLE}\nUser: {question}\nAssistant: <think>"
    if template == "chat":
        return [{"role": "user", "content": f"{question}\n\n{CHAT_FORMAT_NOTE}"}]
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


def _fence(tag: str, body: str) -> str:
    return f"```{tag}\n{body.rstrip()}\n```"


def _rules(banned: Sequence[str]) -> str:
    return "\n".join([
        "Rules for the program:",
        "- The entry point is a function named `f` that takes at least one argument and returns a value.",
        "- You may define helper functions inside `f` and classes at the top; put every import at the top.",
        "- It must be deterministic: the same input always gives the same output. No randomness, no dates or "
        "clocks, no reading or writing files, no network, no printing, no reading input, no global state that "
        "changes between calls.",
        "- It must finish well within 10 seconds.",
        "- Never use these modules or names, in any form, not even in comments: " + ", ".join(banned) + ".",
        "- Write the input as the arguments exactly as they would appear inside the call `f(...)`, for example "
        "`'abc', [1, 2, 3]` for a two-argument function. Use only plain values (numbers, strings, lists, "
        "tuples, dicts, sets, booleans, None).",
    ])


def _reference_block(t: Task, with_output: bool = True) -> str:
    parts = [_fence("python", t.program), _fence("input", t.input)]
    if with_output and t.output:
        parts.append(_fence("output", t.output))
    return "\n".join(parts)


def _references(refs: Sequence[Task]) -> str:
    if not refs:
        return ""
    blocks = [f"Reference {i + 1}:\n{_reference_block(t)}" for i, t in enumerate(refs)]
    return ("Here are earlier programs with an input and the output they produce. Make yours clearly different "
            "from all of them:\n\n" + "\n\n".join(blocks) + "\n\n")


_IO_GOAL = {
    "code_o": ("Someone will be shown your program and your input and must work out the exact output. Aim for "
               "an output that takes careful step-by-step reasoning to predict, but can be worked out by hand."),
    "code_i": ("Someone will be shown your program and the output it produced and must work out an input that "
               "produces it. Aim for an input that takes careful reasoning to recover from the output, but can "
               "be found by hand."),
}


def _io_proposer(task_type: str, refs: Sequence[Task], cfg: TasksConfig) -> str:
    return "\n\n".join([
        "Design a new Python program together with one input for it, to test someone's ability to reason "
        "about code. " + _IO_GOAL[task_type],
        _rules(cfg.banned_keywords),
        _references(refs).rstrip(),
        "Plan the program in your reasoning first. Then, inside <answer>, give exactly one program and one "
        "input in this format:\n" + _fence("python", "def f(...):\n    ...") + "\n" + _fence("input", "..."),
    ]).replace("\n\n\n\n", "\n\n")


def _code_f_proposer(program: Task, cfg: TasksConfig) -> str:
    fences = "\n".join(_fence("input", f"... input {i + 1} ...") for i in range(2)) + "\n..."
    return "\n\n".join([
        "Here is a Python program. Someone will see only some input/output examples of it and a short message "
        f"from you, and must write the function. Propose {cfg.num_inputs} different inputs that together reveal "
        "what the function does (include edge cases), and a message that hints at its purpose without giving "
        "the code away.",
        _fence("python", program.program),
        "Each input is the arguments exactly as they would appear inside the call `f(...)`, using only plain "
        "values (numbers, strings, lists, tuples, dicts, sets, booleans, None). Inputs must be valid for the "
        "program and run without errors.",
        f"Reason first. Then, inside <answer>, give {cfg.num_inputs} inputs, each in its own input block, and "
        "one message block:\n" + fences + "\n" + _fence("message", "... your hint ..."),
    ])


def proposer_prompt(task_type: str, cfg: TasksConfig, *, references: Sequence[Task] = (),
                    program: Task | None = None) -> str:
    """The proposer's question text (render it with :func:`render_prompt`).

    code_i / code_o: conditioned on ``references`` (K tasks from the buffer). code_f: on one buffered
    ``program`` for which the proposer writes ``cfg.num_inputs`` inputs and a message.
    """
    if task_type in ("code_i", "code_o"):
        return _io_proposer(task_type, references, cfg)
    if task_type == "code_f":
        if program is None:
            raise ValueError("code_f proposer prompt needs the buffered program")
        return _code_f_proposer(program, cfg)
    raise ValueError(f"unknown task type {task_type!r}")


def solver_prompt(task: Task) -> str:
    """The solver's question text for a validated task."""
    if task.type == "code_o":
        return "\n\n".join([
            "Work out the exact output of this Python program on the given input.",
            _fence("python", task.program),
            _fence("input", task.input),
            "Trace the execution in your reasoning. Then, inside <answer>, give the return value of "
            "`f(<input>)` as a Python value (as `repr` would print it) in an output block:\n"
            + _fence("output", "..."),
        ])
    if task.type == "code_i":
        return "\n\n".join([
            "Find an input for which this Python program returns the given output.",
            _fence("python", task.program),
            _fence("output", task.output),
            "Any input that produces exactly this output is accepted. Reason it out first. Then, inside "
            "<answer>, give the arguments as they would appear inside the call `f(...)`, using only plain values, "
            "in an input block:\n" + _fence("input", "..."),
        ])
    if task.type == "code_f":
        examples = "\n\n".join(f"Example {i + 1}:\n{_fence('input', a)}\n{_fence('output', b)}"
                               for i, (a, b) in enumerate(task.visible_pairs))
        return "\n\n".join([
            "Write a Python function `f` that matches these input/output examples. It will also be checked on "
            "other inputs that you do not see.",
            examples if examples else "(No examples are shown for this task.)",
            "Message from the author of the function:\n" + _fence("message", task.message),
            "Reason first. Then, inside <answer>, give the full program (imports at the top, entry function "
            "`f`, no printing and no input) in a python block:\n" + _fence("python", "def f(...):\n    ..."),
        ])
    raise ValueError(f"unknown task type {task.type!r}")


def proposer_request(task_type: str, buffers: Any, cfg: TasksConfig, rng: Any) -> tuple[str | list[dict[str, str]], Task | None]:
    """A rendered proposer prompt drawn from ``buffers`` (a :class:`~populora_verl.tasks.buffer.TaskBuffers`).

    Returns ``(prompt, program)``: ``program`` is the buffered task shown to a code_f proposer (pass it to
    ``validate_proposal(..., program=program)`` and to the reward manager's ``populora.task``), else ``None``.
    """
    if task_type == "code_f":
        program = buffers.sample_program(rng)
        return render_prompt(proposer_prompt("code_f", cfg, program=program), cfg.prompt_template), program
    refs = buffers.references(task_type, cfg.num_references, rng)
    return render_prompt(proposer_prompt(task_type, cfg, references=refs), cfg.prompt_template), None


def solver_request(task: Task, cfg: TasksConfig) -> str | list[dict[str, str]]:
    """The rendered solver prompt for a validated task."""
    return render_prompt(solver_prompt(task), cfg.prompt_template)
