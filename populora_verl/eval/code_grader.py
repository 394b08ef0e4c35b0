"""HumanEval+ / MBPP+ grading with EvalPlus semantics, executed out of process.

For each task the canonical solution is run (sandboxed, generous limits) on ``base_input + plus_input`` to get
the expected outputs and their timings. A candidate passes *base* when every base input matches, and *plus*
(the HumanEval+ / MBPP+ score) when every base and plus input matches. Per input, as EvalPlus 0.3.1:

- time limit ``max(min_time_limit, gt_time_factor * canonical_time)``; the whole task at most ``task_timeout_s``;
- match = ``out == expected``; if the task's ``atol`` is 0 and the expected value is float(s), atol becomes 1e-6;
  with atol != 0 a non-exact match passes when the types (and lengths) agree and
  ``np.allclose(out, expected, rtol=1e-7, atol=atol)``;
- special oracles: HumanEval/32 ``find_zero`` passes when ``|poly(xs, out)| <= atol`` (the *correct* rule —
  evalplus 0.3.1 has a ``continue`` that fails every solution here, see evalplus PR #201); MBPP set-equality
  tasks compare ``set(out) == set(expected)``; "not None" tasks compare truthiness of a match; and the
  ``are_equivalent`` / ``sum_div`` / ``surface_Area`` / ``digit_distance_nums`` oracles.

The comparison runs here, in the evaluator, on values decoded from plain JSON: the candidate never sees the
expected outputs, so it cannot fake a pass other than by returning the right values.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from populora_verl.eval.sandbox import DEFAULT_LIMITS, RunOutcome, SandboxLimits, decode_value, run_program

__all__ = [
    "Expected",
    "CodeResult",
    "compute_expected",
    "check_candidate",
    "build_program",
    "extract_code",
    "outputs_match",
    "poly",
]

HARNESS_VERSION = "1"
MBPP_SET_EQ = {
    "similar_elements",
    "find_char_long",
    "common_in_nested_lists",
    "extract_singly",
    "larg_nnum",
    "intersection_array",
    "find_dissimilar",
    "Diff",
}
MBPP_NOT_NONE = {"check_str", "text_match_three", "text_starta_endb"}


@dataclass
class Expected:
    """Canonical outputs (tagged JSON, decoded lazily) and seconds per input, base inputs first."""

    values: list[Any]
    times: list[float]
    n_base: int
    error: str | None = None


@dataclass
class CodeResult:
    base_pass: bool
    plus_pass: bool
    error: str | None = None


def poly(xs: list[float], x: float) -> float:
    """HumanEval/32's polynomial: sum(c * x**i)."""
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))


def _surface_area(base_edge: float, height: float) -> float:
    slant = math.sqrt((base_edge / 2) ** 2 + height**2)
    return round(base_edge**2 + 4 * (base_edge * slant) / 2)


def _digit_distance(a: int, b: int) -> int:
    sa, sb = str(a), str(b)
    width = max(len(sa), len(sb))
    return sum(abs(int(x) - int(y)) for x, y in zip(sa.zfill(width), sb.zfill(width)))


def _is_floats(x: Any) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    return False


def _allclose(out: Any, exp: Any, atol: float) -> bool:
    import numpy as np

    if type(out) is not type(exp):
        return False
    if isinstance(exp, (list, tuple)) and len(out) != len(exp):
        return False
    try:
        return bool(np.allclose(out, exp, rtol=1e-07, atol=atol))
    except Exception:  # non-numeric content
        return False


def outputs_match(out: Any, exp: Any, *, atol: float, dataset: str, entry_point: str, args: list[Any]) -> bool:
    """EvalPlus's per-input verdict (see the module docstring). ``args`` are the (deserialised) inputs."""
    try:
        if dataset == "humaneval" and entry_point == "find_zero":
            if isinstance(out, bool) or not isinstance(out, (int, float)):
                return False
            return abs(poly(args[0], out)) <= atol
        exact = out == exp
        if not isinstance(exact, bool):
            exact = False
        if dataset == "mbpp":
            if entry_point == "are_equivalent":
                exact = True
            elif entry_point == "sum_div":
                exact = exact or out == 0
            elif entry_point == "surface_Area":
                exact = exact or (isinstance(out, (int, float)) and abs(out - _surface_area(*args)) <= 1)
            elif entry_point == "digit_distance_nums":
                exact = exact or out == _digit_distance(*args)
            elif entry_point in MBPP_SET_EQ:
                exact = isinstance(out, (list, tuple, set, frozenset, str, dict)) and set(out) == set(exp)
            elif entry_point in MBPP_NOT_NONE:
                exact = out == exp if isinstance(out, bool) else exp == (out is not None)
        if atol == 0 and _is_floats(exp):
            atol = 1e-6
        if not exact and atol != 0:
            return _allclose(out, exp, atol)
        return bool(exact)
    except Exception:  # a decoded value that cannot be compared / hashed (e.g. a set of lists)
        return False


def build_program(gold: dict[str, Any], code: str) -> str:
    """Runnable program for a candidate. HumanEval: the prompt (imports, helpers such as ``poly``, the signature)
    followed by the candidate, whose definition of the entry point replaces the prompt's stub. MBPP: the code."""
    if gold["dataset"] == "humaneval":
        return gold["prompt"] + "    pass\n\n\n" + code if not code.startswith(gold["prompt"]) else code
    return code


def canonical_program(gold: dict[str, Any]) -> str:
    if gold["dataset"] == "humaneval":
        return gold["prompt"] + gold["canonical_solution"]
    return gold["canonical_solution"]


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a response: the first fenced block defining ``entry_point`` (else the longest python block);
    an unclosed trailing fence (cut by max tokens) counts; with no fence at all, the whole text."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if not blocks:
        opened = re.search(r"```[ \t]*(?:python|py)?[^\n]*\n", text)
        if opened:
            return text[opened.end() :]
        return text
    py = [b for lang, b in blocks if lang in ("python", "py", "python3", "")] or [b for _, b in blocks]
    if entry_point:
        pat = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(|^\s*class\s+Solution\b", re.M)
        for b in py:
            if pat.search(b):
                return b
    return max(py, key=len)


def _input_lists(gold: dict[str, Any]) -> list[Any]:
    return list(gold["base_input"]) + list(gold["plus_input"])


def _cache_path(cache_dir: Path | None, gold: dict[str, Any]) -> Path | None:
    if cache_dir is None:
        return None
    h = hashlib.sha256(
        json.dumps(
            [
                HARNESS_VERSION,
                gold["task_id"],
                gold["canonical_solution"],
                gold["prompt"],
                gold["base_input"],
                gold["plus_input"],
            ],
            sort_keys=True,
        ).encode()
    ).hexdigest()
    return cache_dir / f"{gold['dataset']}-{h[:24]}.json"


def compute_expected(
    gold: dict[str, Any], *, cache_dir: str | os.PathLike | None = None, timeout_s: float = 600.0, memory_mb: int = 4096
) -> Expected:
    """Run the canonical solution on every input (cached on disk by content hash when ``cache_dir`` is set)."""
    cpath = _cache_path(Path(cache_dir) if cache_dir else None, gold)
    if cpath is not None and cpath.is_file():
        with open(cpath, encoding="utf-8") as f:
            d = json.load(f)
        return Expected(d["values"], d["times"], d["n_base"], d.get("error"))
    inputs = _input_lists(gold)
    limits = SandboxLimits(memory_mb=memory_mb, exec_timeout_s=60.0)
    outcome = run_program(
        canonical_program(gold),
        inputs,
        mode="call",
        entry_point=gold["entry_point"],
        time_limits=[max(20.0, timeout_s / 4)] * len(inputs),
        wall_timeout_s=timeout_s,
        limits=limits,
        deserialize="mbpp" if gold["dataset"] == "mbpp" else None,
        task_id=gold["task_id"],
        stop_on_error=False,
    )
    exp = _expected_from(outcome, len(inputs), len(gold["base_input"]))
    if cpath is not None and exp.error is None:
        cpath.parent.mkdir(parents=True, exist_ok=True)
        tmp = cpath.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"values": exp.values, "times": exp.times, "n_base": exp.n_base}, f)
        os.replace(tmp, cpath)
    return exp


def _expected_from(outcome: RunOutcome, n: int, n_base: int) -> Expected:
    if outcome.error is not None:
        return Expected([], [], n_base, f"canonical solution failed: {outcome.error}")
    bad = [r for r in outcome.rows if r.get("s") != "ok"]
    if bad or len(outcome.rows) != n:
        why = bad[0].get("e") if bad else f"{len(outcome.rows)}/{n} outputs"
        return Expected([], [], n_base, f"canonical solution failed: {why}")
    return Expected([r["v"] for r in outcome.rows], [float(r.get("t", 0.0)) for r in outcome.rows], n_base)


def _deserialized_args(gold: dict[str, Any]) -> list[Any]:
    """Inputs as the harness passes them (MBPP+ tuples etc.), for the oracles that look at the arguments."""
    inputs = _input_lists(gold)
    if gold["dataset"] != "mbpp":
        return inputs
    from importlib import util

    spec = util.spec_from_file_location("_populora_harness", Path(__file__).with_name("_harness.py"))
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # our own stdlib-only file; its main() only runs as a script
    return mod._mbpp_deserialize(gold["task_id"], inputs)


def check_candidate(
    gold: dict[str, Any], response_code: str, expected: Expected, *, limits: SandboxLimits = DEFAULT_LIMITS
) -> CodeResult:
    """Grade one extracted candidate program (already passed through :func:`extract_code`)."""
    if expected.error is not None:
        return CodeResult(False, False, expected.error)
    inputs = _input_lists(gold)
    time_limits = [max(limits.min_time_limit_s, limits.gt_time_factor * t) for t in expected.times]
    wall = min(limits.task_timeout_s, sum(time_limits)) + 1.0
    outcome = run_program(
        build_program(gold, response_code),
        inputs,
        mode="call",
        entry_point=gold["entry_point"],
        time_limits=time_limits,
        wall_timeout_s=wall + limits.exec_timeout_s,
        limits=limits,
        deserialize="mbpp" if gold["dataset"] == "mbpp" else None,
        task_id=gold["task_id"],
    )
    args = None
    wrong = None
    verdicts: list[bool] = []
    for row in outcome.rows:
        if row.get("s") != "ok":
            break
        i = int(row["i"])
        try:
            out = decode_value(row["v"])
            exp = decode_value(expected.values[i])
        except (ValueError, TypeError, KeyError, RecursionError):
            break
        if gold["dataset"] == "mbpp" and gold["entry_point"] in MBPP_NOT_NONE:
            exp = exp is not None
        if args is None and (gold["entry_point"] in ("find_zero", "surface_Area", "digit_distance_nums")):
            args = _deserialized_args(gold)
        ok = outputs_match(
            out,
            exp,
            atol=gold["atol"],
            dataset=gold["dataset"],
            entry_point=gold["entry_point"],
            args=list(args[i]) if args is not None else [],
        )
        verdicts.append(ok)
        if not ok:
            wrong = f"wrong output on {'base' if i < expected.n_base else 'plus'} input {i}"
            break
    n_base = expected.n_base
    base_ok = len(verdicts) >= n_base and all(verdicts[:n_base])
    plus_ok = base_ok and len(verdicts) == len(inputs) and all(verdicts)
    err = outcome.error or wrong
    if err is None and outcome.rows and outcome.rows[-1].get("s") != "ok":
        err = outcome.rows[-1].get("e")
    return CodeResult(base_ok, plus_ok, None if plus_ok else err)
