"""Prompt templates: our default wording, and ``populora.tasks.prompt_file`` to replace any of them.

Each template is a ``str.format`` string (literal braces doubled: ``{{`` / ``}}``) that may use only the
placeholders listed in :data:`PLACEHOLDERS` and must use the ones in :data:`REQUIRED`. A prompt file is YAML or
JSON mapping template names to strings; names it leaves out keep the default. It is checked when the config is
built, so a typo fails at start-up with one line.

The default proposer templates carry every requirement AZR's proposer prompts state (in our words): entry function
``f`` with at least one parameter and a return value, nested helpers and top-of-file classes and imports allowed,
nothing after ``f``'s return, determinism (no randomness, time, I/O, printing, logging or outside state), a 10 s
budget, state tracked across several data transformations so the task takes many reasoning steps, the suggested
data structures and algorithms, a program unlike the references, the banned words (even in comments), the test
input kept out of the program, one input written as call arguments, and a plan before the answer. The code_f
proposer asks for ``num_inputs`` inputs that cover the input space and differ from each other and a message that
helps without giving the code away, so that the whole is hard for the solver but not impossible.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Mapping

__all__ = ["DEFAULT_TEMPLATES", "PLACEHOLDERS", "REQUIRED", "load_prompt_file", "check_templates"]

_PROGRAM_RULES = """\
Requirements for the program:
- The entry point is a function named `f` that takes at least one argument and returns a value. Helper functions \
may be nested inside `f`; custom classes are allowed and go at the top, together with every import.
- The program ends with the return statement of `f`; anything written after it is cut off.
- It is deterministic: the same input always gives the same result. Do not use randomness, dates or clocks, files \
or the network, printing or logging, or any state outside the function.
- It finishes well within 10 seconds on an ordinary CPU.
- It makes the reader follow values through several successive transformations of the data, keeping track of \
state at every step, so that working it out takes a long chain of reasoning.
- Do not write the test input inside the program; it goes in the input block.
- These words must not appear in your program in any form, not even inside comments: {banned_keywords}."""

_INPUT_RULES = """\
Requirements for the input:
- Give exactly one input.
- Write it as the arguments of the call `f(...)`: several arguments are separated by commas, strings are quoted, \
and only plain values are used (numbers, strings, lists, tuples, dicts, sets, booleans, None)."""

_JUDGED = """\
How your proposal is judged:
- It must run: the program has to execute on your input without errors.
- {difficulty} Get the difficulty from algorithmic depth or intricate logic: for example, define data structures \
such as trees, heaps, stacks, queues or graphs and operate on them, or use involved control flow, dynamic \
programming, recursion, divide and conquer, greedy choices or backtracking.
- It must be new: clearly different from every reference program below.
- It must respect the forbidden words above."""

_IO_TAIL = """\
Before answering, make a plan in your reasoning: decide what will make the task hard, how it differs from the \
references and what is original about it. Then, inside <answer>, give exactly one program and one input in this \
format:
```python
def f(...):
    ...
    return ...
```
```input
arg1, arg2, ...
```

Reference programs, each with an input and the output it produces:

{references}"""

_DIFFICULTY = {
    "code_o": (
        "It must be hard to predict: someone who sees your program and your input, but not the output, has "
        "to work out the exact output."
    ),
    "code_i": (
        "It must be hard to invert: someone who sees your program and the output it returned, but not your "
        "input, has to find an input that produces that output."
    ),
}


def _io_proposer(task_type: str) -> str:
    return "\n\n".join(
        [
            "Design a new Python program and one input for it, as a test of someone's ability to reason about code.",
            _PROGRAM_RULES,
            _INPUT_RULES,
            _JUDGED.replace("{difficulty}", _DIFFICULTY[task_type]),
            _IO_TAIL,
        ]
    )


DEFAULT_TEMPLATES: dict[str, str] = {
    # Plain-text wrapper of tasks.prompt_template=azr (AZR feeds base models this way, not with a chat template).
    "azr_wrapper": (
        "A conversation between User and Assistant. The User asks a question and the Assistant answers it. The "
        "Assistant first reasons about the question step by step, then gives the answer. The reasoning is written "
        "inside <think> </think> tags and the answer inside <answer> </answer> tags, like this: <think> reasoning "
        "here </think> <answer> answer here </answer>.\nUser: {question}\nAssistant: <think>"
    ),
    # The one user message of tasks.prompt_template=chat.
    "chat_wrapper": (
        "{question}\n\nReason step by step inside <think> </think> tags first, then give your final answer inside "
        "<answer> </answer> tags: <think> reasoning here </think> <answer> answer here </answer>."
    ),
    "propose_code_o": _io_proposer("code_o"),
    "propose_code_i": _io_proposer("code_i"),
    # One buffer task shown to a code_i / code_o proposer ({references} joins them with blank lines).
    "reference": "Reference {index}:\n```python\n{program}\n```\n```input\n{input}\n```\n```output\n{output}\n```",
    "propose_code_f": """\
Here is a Python program. Choose {num_inputs} inputs for it that produce a varied set of outputs, and write a \
message about it. Some of your inputs, with the outputs they produce, will be shown together with your message to \
someone who must reconstruct the function without seeing it, like a puzzle in an intelligence test; the other pairs \
are kept back to check their function.

```python
{program}
```

Requirements for the inputs:
- Give exactly {num_inputs} inputs, each in its own input block.
- Write each as the arguments of the call `f(...)`: several arguments are separated by commas, strings are quoted, \
and only plain values are used (numbers, strings, lists, tuples, dicts, sets, booleans, None).
- Every input must run on the program without errors: a single failing input rejects the whole proposal.

Requirements for the message:
- Put it in one message block. It can take any form: a coding question, or a plain description of what the \
function does.
- It must not contain the program or code copied from it.

How your proposal is judged:
- Coverage: together the inputs and outputs span the whole input space of the program, so that the function can \
be inferred from them.
- Variety: the inputs are clearly different from one another.
- Difficulty: inputs and message together make a task that is challenging for the solver, but not impossible.

Before answering, make a plan in your reasoning: understand what the program does, then decide how your inputs \
reach high coverage and why they make a challenging, original test. Then, inside <answer>, give the inputs and the \
message:
```input
arg1, arg2, ...
```
```input
...
```
```message
...
```""",
    "solve_code_o": """\
Work out the output this Python program returns for the given input.

```python
{program}
```
```input
{input}
```

Trace the execution step by step in your reasoning. Then, inside <answer>, give the return value of `f(<input>)` \
as a Python value, written as `repr` would print it (strings quoted), in an output block:
```output
...
```""",
    "solve_code_i": """\
Find an input for which this Python program returns the given output.

```python
{program}
```
```output
{output}
```

Any input that produces exactly this output is accepted. Reason it out step by step first. Then, inside <answer>, \
give the arguments as they would appear inside the call `f(...)` (several arguments separated by commas, strings \
quoted, plain values only) in an input block:
```input
...
```""",
    "pair": "Example {index}:\n```input\n{input}\n```\n```output\n{output}\n```",
    "solve_code_f": """\
Write a Python function that reproduces these input/output examples. It will also be checked on other inputs that \
you do not see, so it must capture the general rule, not only the examples.

{pairs}

Message from the author of the function:
```message
{message}
```

Requirements for your program: the entry function is named `f` (helpers may be nested inside it), takes at least \
one argument and returns a value; it is deterministic (no randomness, dates or clocks, files or network, printing \
or logging, or outside state); it finishes within 10 seconds; imports and classes go at the top; nothing follows \
the return statement of `f`.

Reason step by step first. Then, inside <answer>, give the full program in a python block:
```python
def f(...):
    ...
```""",
}

#: What each template may use.
PLACEHOLDERS: dict[str, frozenset[str]] = {
    "azr_wrapper": frozenset({"question"}),
    "chat_wrapper": frozenset({"question"}),
    "propose_code_o": frozenset({"references", "banned_keywords", "num_references"}),
    "propose_code_i": frozenset({"references", "banned_keywords", "num_references"}),
    "reference": frozenset({"index", "program", "input", "output"}),
    "propose_code_f": frozenset({"program", "num_inputs", "banned_keywords"}),
    "solve_code_o": frozenset({"program", "input"}),
    "solve_code_i": frozenset({"program", "output"}),
    "pair": frozenset({"index", "input", "output"}),
    "solve_code_f": frozenset({"pairs", "message", "num_visible"}),
}

#: What each template must use: without it the prompt would not carry its task.
REQUIRED: dict[str, frozenset[str]] = {
    "azr_wrapper": frozenset({"question"}),
    "chat_wrapper": frozenset({"question"}),
    "propose_code_o": frozenset({"references"}),
    "propose_code_i": frozenset({"references"}),
    "reference": frozenset({"program", "input", "output"}),
    "propose_code_f": frozenset({"program", "num_inputs"}),
    "solve_code_o": frozenset({"program", "input"}),
    "solve_code_i": frozenset({"program", "output"}),
    "pair": frozenset({"input", "output"}),
    "solve_code_f": frozenset({"pairs", "message"}),
}


def _fields(name: str, text: str) -> set[str]:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:  # a lone "{" or "}"
        raise ValueError(
            f"template {name!r} is not a valid format string ({e}); write literal braces as {{{{ }}}}"
        ) from e
    out = set()
    for _, field, spec, conv in parsed:
        if field is None:
            continue
        if field == "" or not field.isidentifier():
            raise ValueError(
                f"template {name!r} has a bad placeholder {{{field}}} (use named ones: "
                f"{', '.join('{' + p + '}' for p in sorted(PLACEHOLDERS[name]))})"
            )
        if spec or conv:
            raise ValueError(f"template {name!r}: placeholder {{{field}}} may not carry a format spec or conversion")
        out.add(field)
    return out


def check_templates(templates: Mapping[str, Any]) -> dict[str, str]:
    """The defaults overridden by ``templates``; ``ValueError`` (one line) on an unknown name or placeholder."""
    if not isinstance(templates, Mapping):
        raise ValueError(f"must map template names to strings, got {type(templates).__name__}")
    out = dict(DEFAULT_TEMPLATES)
    for name, text in templates.items():
        if name not in DEFAULT_TEMPLATES:
            raise ValueError(f"unknown template {name!r} (known: {', '.join(sorted(DEFAULT_TEMPLATES))})")
        if not isinstance(text, str):
            raise ValueError(f"template {name!r} must be a string, got {type(text).__name__}")
        used = _fields(name, text)
        bad = sorted(used - PLACEHOLDERS[name])
        if bad:
            raise ValueError(
                f"template {name!r} uses unknown placeholder {{{bad[0]}}} (allowed: "
                f"{', '.join('{' + p + '}' for p in sorted(PLACEHOLDERS[name]))})"
            )
        missing = sorted(REQUIRED[name] - used)
        if missing:
            raise ValueError(f"template {name!r} lacks the placeholder {{{missing[0]}}}")
        out[name] = text
    return out


def load_prompt_file(path: str | Path) -> dict[str, str]:
    """Read a YAML/JSON prompt file and return the full template set (defaults for the names it leaves out)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such file {str(path)!r}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML/JSON ({' '.join(str(e).split())})") from None
    return check_templates(data or {})
