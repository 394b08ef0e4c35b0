"""Parsing model text: the ``<think>…</think><answer>…</answer>`` envelope, fenced blocks, static program checks.

Everything here is pure text / AST work. Nothing is executed: model text is hostile, and only the executor
(a separate, sandboxed process) ever runs it. Every function returns a value or raises :class:`ParseError`
with a one-line reason; callers turn that into the format/invalid penalty.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Sequence

# The executor's runner holds the same static policy helpers (stdlib only, safe to import here).
from populora_verl.executor._runner import _attr_chain as _dotted
from populora_verl.executor._runner import _banned_match as _module_banned

__all__ = [
    "ParseError",
    "normalise_response",
    "check_format",
    "extract_answer",
    "envelope_problem",
    "answer_fallback",
    "fenced_blocks",
    "first_block",
    "extract_solver_payload",
    "CheckedProgram",
    "check_program",
    "find_banned",
    "check_call_args",
    "is_value_expression",
    "literal_args",
    "parse_literal",
    "unsafe_text",
    "normalise_program",
    "MAX_RESPONSE_CHARS",
]

# Model text is scanned with str.find and anchored matches only: every scan below is linear in the text
# (a regex with a lazy body per candidate start, as in AZR, is quadratic on e.g. 60k backticks).
_WS_RE = re.compile(r"\s*")
_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-")
_INPUT_CALL_RE = re.compile(r"\binput\s*\(")
#: Longest model response the parsers look at (``tasks.max_response_chars`` overrides it per run).
MAX_RESPONSE_CHARS = 65_536


class ParseError(ValueError):
    """The text does not have the required shape. The message is a short reason for logs."""


def normalise_response(text: str, think_prefilled: bool = True) -> str:
    """The response as the format check sees it.

    Both templates end the prompt with the opening ``<think>`` (the ``azr`` template literally, the ``chat``
    template by instruction), so the model's text usually starts inside the think block. We put the tag back
    when it is missing, which makes one format rule serve both.
    """
    if not isinstance(text, str):
        raise ParseError(f"response must be text, got {type(text).__name__}")
    stripped = text.lstrip()
    if think_prefilled and not stripped.startswith("<think>"):
        return "<think>" + text
    return stripped


def check_format(text: str) -> bool:
    """AZR's envelope check on a normalised response: it starts with ``<think>``, and some ``</think>`` is
    followed (after whitespace) by ``<answer>`` with a ``</answer>`` later on."""
    text = text.lstrip()
    if not text.startswith("<think>"):
        return False
    pos = len("<think>")
    while True:
        k = text.find("</think>", pos)
        if k < 0:
            return False
        j = _WS_RE.match(text, k + len("</think>")).end()
        if text.startswith("<answer>", j):
            return text.find("</answer>", j + len("<answer>")) >= 0
        pos = k + 1


def _check_length(text: str, max_chars: int | None) -> None:
    limit = MAX_RESPONSE_CHARS if max_chars is None else max_chars
    if len(text) > limit:
        raise ParseError(f"response longer than {limit} characters")


def extract_answer(text: str, think_prefilled: bool = True, *, max_chars: int | None = None) -> str:
    """The text between the *last* ``<answer>`` and its ``</answer>``; :class:`ParseError` if badly formatted
    or longer than ``max_chars`` (default :data:`MAX_RESPONSE_CHARS`)."""
    if isinstance(text, str):
        _check_length(text, max_chars)
    text = normalise_response(text, think_prefilled)
    if not check_format(text):
        raise ParseError("response is not <think>...</think><answer>...</answer>")
    start = text.rfind("<answer>")
    end = text.find("</answer>", start)
    if end >= 0:
        return text[start + len("<answer>") : end].strip()
    # The last <answer> is unclosed: fall back to the last complete pair.
    last = _last_complete_answer(text)
    if last is None:
        raise ParseError("no complete <answer> block")
    return last


def _last_complete_answer(text: str) -> str | None:
    """The body of the last complete ``<answer>…</answer>`` pair, scanning non-overlapping pairs left to right
    (linear), stripped; None if there is none."""
    last, pos = None, 0
    while True:
        a = text.find("<answer>", pos)
        if a < 0:
            break
        b = text.find("</answer>", a + len("<answer>"))
        if b < 0:
            break
        last, pos = text[a + len("<answer>") : b], b + len("</answer>")
    return None if last is None else last.strip()


def envelope_problem(text: str, think_prefilled: bool = True) -> str | None:
    """Why a response fails AZR's envelope check (``no </think>``, ``no <answer> after </think>``, ``<answer> not
    closed``), or None when it passes. Short fixed phrases: they become metric names and log lines."""
    text = normalise_response(text, think_prefilled)
    if check_format(text):
        return None
    if "</think>" not in text:
        return "no </think>"
    after = text[text.rfind("</think>") + len("</think>") :]
    if "<answer>" not in after:
        return "no <answer> after </think>"
    return "<answer> not closed"


def answer_fallback(text: str, think_prefilled: bool = True, *, max_chars: int | None = None) -> str:
    """What AZR reads a proposal from when its envelope fails the format check: the last complete
    ``<answer>…</answer>`` pair, else the text after the last ``<answer>`` (cut off at the token cap), else the
    text after the last ``</think>``, else the whole response. The caller still scores the envelope as a format
    error; this only decides whether the program inside is a usable task. :class:`ParseError` when longer than
    ``max_chars`` (default :data:`MAX_RESPONSE_CHARS`), as :func:`extract_answer`."""
    if isinstance(text, str):
        _check_length(text, max_chars)
    text = normalise_response(text, think_prefilled)
    last = _last_complete_answer(text)
    if last is not None:
        return last
    for tag in ("<answer>", "</think>"):
        k = text.rfind(tag)
        if k >= 0:
            return text[k + len(tag) :].strip()
    return text[len("<think>") :].strip() if text.startswith("<think>") else text.strip()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """All fenced blocks as ``(language tag lower-cased, body)`` in order of appearance.

    A fence is three backticks, optional blanks, a tag of ``[A-Za-z0-9_+-]``, the rest of that line, a
    newline, the body, and the next three backticks. One left-to-right pass.
    """
    out: list[tuple[str, str]] = []
    pos = 0
    while True:
        i = text.find("```", pos)
        if i < 0:
            return out
        nl = text.find("\n", i + 3)
        if nl < 0:
            return out  # no newline after any later fence either
        close = text.find("```", nl + 1)
        if close < 0:
            return out  # nothing closes this fence, nor any later one
        header = text[i + 3 : nl].lstrip(" \t")
        n = 0
        while n < len(header) and header[n] in _TAG_CHARS:
            n += 1
        out.append((header[:n].lower(), text[nl + 1 : close]))
        pos = close + 3


def first_block(text: str, tags: Iterable[str]) -> str | None:
    """Body of the first fenced block whose tag is in ``tags`` (``None`` if there is none)."""
    wanted = {t.lower() for t in tags}
    for tag, body in fenced_blocks(text):
        if tag in wanted:
            return body
    return None


def _tagged(text: str, tag: str) -> str | None:
    """Body of the first ``<tag>...</tag>`` (case-insensitive tags), linear."""
    m = re.search(f"<{re.escape(tag)}>", text, re.IGNORECASE)
    if not m:
        return None
    end = re.compile(f"</{re.escape(tag)}>", re.IGNORECASE).search(text, m.end())
    return text[m.end() : end.start()] if end else None


def _after_marker(text: str, marker_re: str) -> str | None:
    m = re.search(marker_re, text, re.IGNORECASE)
    if not m:
        return None
    rest = text[m.end() :].strip()
    return rest.splitlines()[0].strip().rstrip(".") if rest else None


def extract_solver_payload(answer: str, task_type: str) -> str:
    """The solver's payload inside the answer: output (code_o), input (code_i) or program (code_f).

    Preference order: the type's fenced block, any untagged fence, then AZR's fallbacks (``<input>`` tags,
    ``# Input:`` lines, "the input is ..."), then the bare answer text.
    """
    if task_type == "code_f":
        body = first_block(answer, ("python", "py"))
        if body is None:
            body = first_block(answer, ("",))
        if body is None:
            body = answer
    else:
        kind = "output" if task_type == "code_o" else "input"
        body = first_block(answer, (kind,))
        if body is None:
            body = first_block(answer, ("", "python", "py"))
        if body is None:
            body = _tagged(answer, kind)
        if body is None:
            body = _after_marker(answer, rf"#\s*{kind}\s*:")
        if body is None:
            body = _after_marker(answer, rf"\bthe {kind} is\b:?")
        if body is None:
            body = answer
    body = body.strip()
    if not body:
        raise ParseError(f"empty {task_type} answer")
    return body


# --- programs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckedProgram:
    """A program that passed the static checks, with its entry function renamed to ``f``."""

    code: str
    original_name: str


def find_banned(tree: ast.AST, banned: Sequence[str]) -> str | None:
    """The first banned module / dotted name used by the program, or ``None``.

    Imports are checked by module (``import os.path``, ``from os import path`` and ``from os.path import x``
    all hit ``os.path``), dotted attribute uses (``os.environ``, ``sys.exit``) by their path, and
    ``__import__("random")`` by its constant argument.
    """
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" if mod else a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            d = _dotted(node)
            names = [d] if d else []
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for n in names:
            hit = _module_banned(n, banned)
            if hit:
                return hit
    return None


def _regex_banned(code: str, banned: Sequence[str]) -> str | None:
    # Used only when the program does not parse (AZR's fallback); the program is rejected anyway.
    for b in banned:
        if re.search(rf"\b{re.escape(b)}\b", code):
            return b
    return None


def _rename_function(code: str, old: str, new: str) -> str:
    """Rename identifier ``old`` to ``new`` token-wise (not inside strings/comments, not after a dot)."""
    if old == new:
        return code
    lines = code.splitlines(keepends=True)
    hits: list[tuple[int, int]] = []
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME and tok.string == old and not (prev is not None and prev.string == "."):
            hits.append(tok.start)
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok
    for row, col in reversed(hits):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "".join(lines)


def check_program(
    code: str, banned: Sequence[str], *, max_chars: int | None = None, single_function: bool = True
) -> CheckedProgram:
    """AZR's static checks; returns the program with its entry function named ``f``.

    - size cap, ``ast.parse``;
    - no banned module or keyword (AST walk; regex fallback before giving up on a syntax error), no ``input(``;
    - ``single_function``: exactly one top-level function (proposals). Otherwise (solver programs) helpers are
      allowed and the entry function is ``f`` if defined, else the only top-level function;
    - the entry function takes at least one parameter.
    """
    if not isinstance(code, str) or not code.strip():
        raise ParseError("empty program")
    if max_chars is not None and len(code) > max_chars:
        raise ParseError(f"program longer than {max_chars} characters")
    if _INPUT_CALL_RE.search(code):
        raise ParseError("program calls input(")
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        hit = _regex_banned(code, banned)
        raise ParseError(f"banned keyword {hit!r}" if hit else f"syntax error: {type(e).__name__}") from None
    hit = find_banned(tree, banned)
    if hit:
        raise ParseError(f"banned keyword {hit!r}")
    funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not funcs:
        raise ParseError("no top-level function")
    if single_function:
        if len(funcs) != 1:
            raise ParseError(f"expected exactly one top-level function, found {len(funcs)}")
        entry = funcs[0]
    else:
        named_f = [n for n in funcs if n.name == "f"]
        if named_f:
            entry = named_f[-1]
        elif len(funcs) == 1:
            entry = funcs[0]
        else:
            raise ParseError("several top-level functions and none is named f")
    if isinstance(entry, ast.AsyncFunctionDef):
        raise ParseError("entry function must not be async")
    a = entry.args
    if not (a.posonlyargs or a.args or a.vararg):
        raise ParseError("entry function takes no positional parameter")
    if entry.name != "f":
        # Another top-level binding called ``f`` would be shadowed by the rename: refuse instead of guessing.
        if any(isinstance(n, ast.Name) and n.id == "f" for n in ast.walk(tree)) or any(
            isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == "f" for n in ast.walk(tree)
        ):
            raise ParseError(f"cannot rename {entry.name!r} to f: the name f is already used")
        try:
            code = _rename_function(code, entry.name, "f")
        except (tokenize.TokenError, IndentationError, SyntaxError):
            raise ParseError("program does not tokenize") from None
    return CheckedProgram(code=code.strip("\n") + "\n", original_name=entry.name)


def check_call_args(text: str) -> str:
    """Check ``text`` is an argument list (``"'abc', 3"``) and return it stripped; no evaluation.

    ``f(<text>)`` must parse as exactly one call of ``f``, so text that closes the call and appends more code
    (``"1) or (2"``) is refused.
    """
    if not isinstance(text, str):
        raise ParseError("input must be text")
    text = text.strip()
    if not text:
        raise ParseError("empty input")
    try:
        tree = ast.parse(f"f({text}\n)", mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ParseError("input is not a valid argument list") from None
    body = tree.body
    if not (isinstance(body, ast.Call) and isinstance(body.func, ast.Name) and body.func.id == "f"):
        raise ParseError("input is not a valid argument list")
    if not (body.args or body.keywords):
        raise ParseError("empty input")
    return text


_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def parse_literal(text: str) -> tuple[bool, object]:
    """``(True, value)`` if ``text`` is one literal of builtin types (``ast.literal_eval``), else ``(False, None)``.

    Plain data only: no names, calls or operators besides signed numbers, so evaluating it runs no model code
    and ``==`` on the result is the builtin one (an answer cannot bring its own ``__eq__``). The parser bounds
    the nesting depth; never raises.
    """
    if not isinstance(text, str):
        return False, None
    try:
        return True, ast.literal_eval(text.strip())
    except _LITERAL_ERRORS:
        return False, None


def literal_args(text: str) -> tuple:
    """The values of an argument list made of literals only (``"'abc', 3, k=[1]"``) as ``(args, kwargs)``;
    :class:`ParseError` otherwise. Inputs of tasks must be plain data, like outputs."""
    try:
        tree = ast.parse(f"f({text}\n)", mode="eval")
        call = tree.body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "f"):
            raise ParseError("input is not a valid argument list")
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            raise ParseError("input uses * or ** unpacking")
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = tuple((k.arg, ast.literal_eval(k.value)) for k in call.keywords)
    except ParseError:
        raise
    except _LITERAL_ERRORS:
        raise ParseError("input is not made of plain literals") from None
    return args, kwargs


def unsafe_text(text: str) -> str | None:
    """Why ``text`` cannot go into a prompt as is (NUL, terminal escapes and other control characters, lone
    surrogates that UTF-8 cannot encode), or None. Newlines, tabs and carriage returns are fine."""
    if text.isprintable():
        return None
    for ch in text:
        if ch not in "\n\t\r" and not ch.isprintable() and unicodedata.category(ch) in ("Cc", "Cs"):
            return f"control or unencodable character U+{ord(ch):04X}"
    return None


# Names a solver's literal may use: constants and the containers whose repr is a constructor call.
_VALUE_NAMES = frozenset(
    {
        "True",
        "False",
        "None",
        "inf",
        "nan",
        "set",
        "frozenset",
        "dict",
        "list",
        "tuple",
        "float",
        "int",
        "str",
        "bytes",
        "complex",
        "range",
        "Counter",
        "OrderedDict",
        "defaultdict",
        "deque",
        "Ellipsis",
    }
)
_VALUE_NODES = (
    ast.Expression,
    ast.Constant,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.UnaryOp,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Load,
    ast.keyword,
    ast.Call,
    ast.Name,
)


def is_value_expression(text: str, *, as_args: bool = False) -> bool:
    """Whether solver text is a plain value (literals, containers, ``set()``/``Counter({...})``-style calls).

    Solver text reaches the executor inside a comparison; a lambda, attribute access or arbitrary call could
    build an object whose ``__eq__``/``__repr__`` forges a match, so only value-shaped text is compared by
    value. ``as_args``: the text is an argument list (``"1, 'a'"``) rather than one expression.
    """
    try:
        src = f"f({text}\n)" if as_args else f"({text}\n)"
        tree = ast.parse(src, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    root = tree.body
    if as_args:
        if not (isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "f"):
            return False
        parts: list[ast.AST] = list(root.args) + [k.value for k in root.keywords]
        if any(k.arg is None for k in root.keywords):
            return False
    else:
        parts = [root]
    for part in parts:
        for node in ast.walk(part):
            if not isinstance(node, _VALUE_NODES):
                return False
            if isinstance(node, ast.Name) and node.id not in _VALUE_NAMES:
                return False
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _VALUE_NAMES):
                return False
            if isinstance(node, ast.keyword) and node.arg is None:
                return False
    return True


def normalise_program(code: str) -> str:
    """Canonical text for de-duplication: the AST unparsed (comments and layout gone), else collapsed text."""
    try:
        return ast.unparse(ast.parse(code))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return " ".join(code.split())
