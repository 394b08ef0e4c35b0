"""Math answers: extract the model's final answer and test it against the gold with ``math-verify``.

Extraction follows the Qwen2.5-Math harness AZR evaluates with: the last ``\\boxed{...}`` (or ``\\fbox``); failing
that, the text after "the answer is"; failing that, the last number in the response. Equivalence: a numeric
fast path (relative tolerance 1e-4, commas / ``$`` / ``\\%`` / ``\\text{}`` units stripped), then
``math_verify.verify(parse(gold), parse(pred))``. math-verify bounds its sympy work with ``signal.alarm``, which
only works in the main thread; elsewhere we pass ``None`` timeouts (the evaluator grades in the main thread).
"""

from __future__ import annotations

import math
import re
import threading

__all__ = ["extract_boxed", "extract_answer", "math_equal", "score_math"]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of ``\\boxed 5``; else None."""
    if not isinstance(text, str):
        return None
    last = None
    for m in _BOX.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if depth == 0:
                last = text[i + 1 : j]
        else:
            tail = re.match(r"([^\s$]+)", text[i:])
            if tail:
                last = tail.group(1)
    return last.strip() if last is not None else None


def extract_answer(text: str) -> str | None:
    """The model's final answer: last boxed, else "the answer is X", else the last number; None if nothing."""
    if not isinstance(text, str) or not text:
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = re.findall(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.|\n|$)", text, flags=re.IGNORECASE)
    if m:
        return m[-1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "") if nums else None


def _strip_units(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{[^{}]*\}", "", s)  # units / words
    s = s.replace("\\%", "").replace("%", "").replace("\\!", "").replace("\\,", "").replace("^\\circ", "")
    s = s.replace("^{\\circ}", "").replace("\\$", "").replace("dfrac", "frac").strip()
    return s.rstrip(".").strip()


def _as_number(s: str) -> float | None:
    s = _strip_units(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        x = float(s)
    except ValueError:
        m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
        if not m:
            return None
        num, den = int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        x = (-1 if m.group(1) else 1) * num / den
    return x if math.isfinite(x) else None


def _timeouts() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equal(pred: str | None, gold: str) -> bool:
    """Whether the extracted answer ``pred`` equals ``gold`` (numbers within rel 1e-4, else math-verify)."""
    if pred is None or not str(pred).strip():
        return False
    pred, gold = str(pred), str(gold)
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)
    if _strip_units(pred) == _strip_units(gold):
        return True
    from math_verify import parse, verify  # heavy (sympy): imported on first use

    t = _timeouts()
    try:
        g = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=t)
        p = parse(f"\\boxed{{{pred}}}", parsing_timeout=t)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=t))
    except Exception:  # math-verify raises on pathological input despite raise_on_error=False in places
        return False


def score_math(response: str, gold: str) -> tuple[bool, str | None]:
    """(correct, extracted answer) for one model response."""
    pred = extract_answer(response)
    return math_equal(pred, gold), pred
