"""LiveCodeBench (code generation) from a user-supplied release jsonl, graded in the sandbox.

Row format (LCB ``code_generation_lite`` ``test*.jsonl``): ``question_id``, ``question_title``,
``question_content``, ``platform``, ``difficulty``, ``contest_date``, ``starter_code``, ``public_test_cases``
(a JSON string: a list of ``{"input", "output", "testtype": "stdin" | "functional"}``),
``private_test_cases`` and ``metadata`` (JSON string; ``func_name`` for functional problems).

**Private tests are treated as hostile.** Upstream stores them as base64(zlib(pickle(json-string))). Unpickling
runs arbitrary code, so this loader never unpickles: it accepts private tests as a JSON list, a JSON string,
or base64/zlib-compressed JSON, and rejects a pickle payload with :class:`LCBFormatError` (or, with
``on_pickle="public_only"``, grades that problem on its public tests and marks ``meta["private_skipped"]``).
To use upstream files, convert the private tests to plain JSON once with your own trusted tooling.

Grading (LCB's rules): stdin problems run the program once per test with the input on stdin; the output
matches when the stripped lines match, numerically within 1e-9 token by token when not textually.
Functional problems call ``Solution().<func_name>(*args)`` (args: one JSON value per input line) and compare
with the JSON-decoded output.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from pathlib import Path
from typing import Any

from populora_verl.eval.items import Item, read_jsonl
from populora_verl.eval.sandbox import DEFAULT_LIMITS, SandboxLimits, decode_value, run_program

__all__ = ["LCBFormatError", "load_lcb_items", "decode_private_tests", "check_lcb", "stdout_matches"]

MAX_DECOMPRESSED = 256 * 1024 * 1024


class LCBFormatError(ValueError):
    """An LCB row cannot be read safely (missing fields, pickle payload, bad JSON)."""


def _json_tests(obj: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(obj, str):
        obj = json.loads(obj)
    if not isinstance(obj, list) or not all(isinstance(t, dict) and "input" in t and "output" in t for t in obj):
        raise LCBFormatError(f"{where}: tests must be a list of {{input, output, testtype}} objects")
    return obj


def decode_private_tests(raw: Any, where: str = "private_test_cases") -> list[dict[str, Any]]:
    """Decode private tests from JSON or base64+zlib JSON; a pickle payload raises :class:`LCBFormatError`."""
    if raw is None or raw == "":
        return []
    if isinstance(raw, list):
        return _json_tests(raw, where)
    if not isinstance(raw, str):
        raise LCBFormatError(f"{where}: expected a string or a list, got {type(raw).__name__}")
    text = raw.strip()
    if text.startswith("[") or text.startswith('"'):
        try:
            return _json_tests(json.loads(text), where)
        except json.JSONDecodeError as e:
            raise LCBFormatError(f"{where}: invalid JSON ({e.msg})") from None
    try:
        blob = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise LCBFormatError(f"{where}: neither JSON nor base64") from None
    try:
        d = zlib.decompressobj()
        blob = d.decompress(blob, MAX_DECOMPRESSED)
        if d.unconsumed_tail:
            raise LCBFormatError(f"{where}: decompressed payload exceeds {MAX_DECOMPRESSED} bytes")
    except zlib.error:
        pass  # plain base64
    try:
        return _json_tests(json.loads(blob.decode("utf-8")), where)
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    if blob[:1] == b"\x80" or blob.rstrip()[-1:] == b".":  # protocol 2+ header / protocol 0-1 STOP opcode
        raise LCBFormatError(
            f"{where}: payload is a Python pickle; refusing to unpickle untrusted data "
            "(convert private tests to JSON first)"
        )
    raise LCBFormatError(f"{where}: decoded payload is not JSON")


def load_lcb_items(path: str | Path, *, name: str = "livecodebench", on_pickle: str = "error") -> list:
    """Items from an LCB release jsonl. ``on_pickle``: ``error`` (default) or ``public_only``."""
    if on_pickle not in ("error", "public_only"):
        raise ValueError(f"on_pickle must be 'error' or 'public_only', got {on_pickle!r}")
    path = Path(path)
    items = []
    for row in read_jsonl(path):
        qid = str(row.get("question_id", row.get("id", "")))
        where = f"{path.name}:{qid}"
        for k in ("question_content", "public_test_cases"):
            if k not in row:
                raise LCBFormatError(f"{where}: missing field {k!r}")
        public = _json_tests(row["public_test_cases"], f"{where}: public_test_cases")
        meta = {
            "platform": row.get("platform"),
            "difficulty": row.get("difficulty"),
            "contest_date": row.get("contest_date"),
            "title": row.get("question_title"),
            "private_skipped": False,
        }
        try:
            private = decode_private_tests(row.get("private_test_cases"), f"{where}: private_test_cases")
        except LCBFormatError:
            if on_pickle != "public_only":
                raise
            private, meta["private_skipped"] = [], True
        md = row.get("metadata") or {}
        if isinstance(md, str):
            md = json.loads(md) if md.strip() else {}
        tests = public + private
        testtype = tests[0].get("testtype", "stdin") if tests else "stdin"
        if testtype == "functional" and not md.get("func_name"):
            raise LCBFormatError(f"{where}: functional tests need metadata.func_name")
        gold = {
            "dataset": "lcb",
            "task_id": qid,
            "tests": tests,
            "testtype": testtype,
            "func_name": md.get("func_name", ""),
            "starter_code": row.get("starter_code") or "",
        }
        items.append(Item(name, qid, "code", row["question_content"], gold, meta))
    return items


def _lines(s: str) -> list[str]:
    return [ln.strip() for ln in s.strip().splitlines()]


def stdout_matches(got: str, want: str) -> bool:
    """LCB's stdout rule: stripped lines equal, else every token equal or numerically within 1e-9."""
    a, b = _lines(got), _lines(want)
    if a == b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        tx, ty = x.split(), y.split()
        if len(tx) != len(ty):
            return False
        for u, v in zip(tx, ty):
            if u == v:
                continue
            try:
                if abs(float(u) - float(v)) > 1e-9:
                    return False
            except ValueError:
                return False
    return True


def check_lcb(
    gold: dict[str, Any], code: str, *, limits: SandboxLimits = DEFAULT_LIMITS, time_limit_s: float = 6.0
) -> tuple[bool, str | None]:
    """(passed, error) for one extracted program on all tests of an LCB problem."""
    tests = gold["tests"]
    if not tests:
        return False, "no tests"
    wall = min(limits.task_timeout_s, time_limit_s * len(tests)) + limits.exec_timeout_s
    if gold["testtype"] == "functional":
        try:
            inputs = [[json.loads(line) for line in t["input"].split("\n") if line.strip()] for t in tests]
            wants = [json.loads(t["output"]) for t in tests]
        except json.JSONDecodeError as e:
            return False, f"bad functional test JSON: {e.msg}"
        out = run_program(
            code,
            inputs,
            mode="lcb_functional",
            entry_point=gold["func_name"],
            time_limits=[time_limit_s] * len(tests),
            wall_timeout_s=wall,
            limits=limits,
        )
        for row, want in zip(out.rows, wants):
            if row.get("s") != "ok":
                return False, row.get("e")
            try:
                got = decode_value(row["v"])
            except (ValueError, TypeError, RecursionError):
                return False, "undecodable output"
            if isinstance(got, tuple):
                got = list(got)
            if got != want:
                return False, f"wrong answer on test {row['i']}"
    else:
        out = run_program(
            code,
            [t["input"] for t in tests],
            mode="stdin",
            time_limits=[time_limit_s] * len(tests),
            wall_timeout_s=wall,
            limits=limits,
        )
        for row, t in zip(out.rows, tests):
            if row.get("s") != "ok":
                return False, row.get("e")
            got = row["v"]
            if not isinstance(got, str) or not stdout_matches(got, t["output"]):
                return False, f"wrong answer on test {row['i']}"
    if len(out.rows) < len(tests):
        return False, out.error or "not all tests ran"
    return True, None
