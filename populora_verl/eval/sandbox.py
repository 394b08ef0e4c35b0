"""Run benchmark programs in a child process with resource limits, and decode what comes back.

EvalPlus-style checks call one program on hundreds of inputs, so each (program, input list) is one child
interpreter (``_harness.py``), not one process per call. The child sets RLIMIT_AS / CPU / FSIZE on itself
before it reads the candidate, runs in its own session and temp directory with a scrubbed environment, and is
killed as a process group at the wall-clock deadline. Results are plain JSON with type tags; this module turns
them back into Python values (tuples, sets, dicts, bytes, complex, big ints) without ``eval``; unknown objects
become :class:`Opaque` (type name + repr), which equal only each other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SandboxLimits", "RunOutcome", "Opaque", "run_program", "decode_value"]

HARNESS = Path(__file__).with_name("_harness.py")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one child run. Defaults follow EvalPlus (per-input time = max(min, factor x canonical time),
    at most ``task_timeout_s`` per task; 4 GiB address space)."""

    memory_mb: int = 4096
    min_time_limit_s: float = 1.0
    gt_time_factor: float = 4.0
    task_timeout_s: float = 60.0
    exec_timeout_s: float = 10.0
    max_result_mb: int = 256

    def __post_init__(self) -> None:
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64, got {self.memory_mb}")
        for k in ("min_time_limit_s", "gt_time_factor", "task_timeout_s", "exec_timeout_s"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)}")


DEFAULT_LIMITS = SandboxLimits()  # frozen: one instance serves as every signature's default


@dataclass
class RunOutcome:
    """What one child run produced: per-input rows (in order, possibly fewer than inputs when it stopped early),
    and a set-up error (syntax error, missing entry point, wall-clock timeout, crash) if there was one."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Opaque:
    """A value of a type the harness does not transfer structurally; it equals only the same type + repr."""

    type_name: str
    text: str


def _decode_float(text: str) -> float:
    if text not in ("nan", "inf", "-inf"):
        raise ValueError(f"bad float tag {text!r}")
    return float(text)


def decode_value(obj: Any) -> Any:
    """Rebuild a Python value from the harness's tagged JSON (inverse of ``_harness._encode``)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode_value(x) for x in obj]
    if not isinstance(obj, dict) or "__t" not in obj:
        raise ValueError("untagged object in harness output")
    tag, v = obj["__t"], obj.get("v")
    if tag == "tuple":
        return tuple(decode_value(x) for x in v)
    if tag == "set":
        return {decode_value(x) for x in v}
    if tag == "frozenset":
        return frozenset(decode_value(x) for x in v)
    if tag == "dict":
        return {decode_value(k): decode_value(x) for k, x in v}
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "hexint":
        return int(v, 16)  # base-16 parsing is exempt from the int-digits limit
    if tag == "float":
        return _decode_float(v)
    if tag == "digest":
        return Opaque("digest", f"{v}:{obj.get('n')}")
    if tag == "repr":
        return Opaque(str(obj.get("type", "?")), str(v))
    raise ValueError(f"unknown tag {tag!r}")


def _child_env(workdir: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def run_program(
    code: str,
    inputs: list[Any],
    *,
    mode: str = "call",
    entry_point: str = "",
    time_limits: list[float] | None = None,
    wall_timeout_s: float = 60.0,
    limits: SandboxLimits = DEFAULT_LIMITS,
    deserialize: str | None = None,
    task_id: str = "",
    stop_on_error: bool = True,
) -> RunOutcome:
    """Run ``code`` on each input in one sandboxed child and return its rows (never raises for bad code).

    ``mode``: ``call`` (``entry_point(*args)``), ``lcb_functional`` (``Solution().entry_point(*args)`` when a
    ``Solution`` class exists) or ``stdin`` (the program runs once per input string; the value is its stdout).
    """
    if mode not in ("call", "stdin", "lcb_functional"):
        raise ValueError(f"unknown mode {mode!r}")
    time_limits = list(time_limits) if time_limits is not None else [limits.min_time_limit_s] * len(inputs)
    if len(time_limits) != len(inputs):
        raise ValueError("time_limits needs one value per input")
    with tempfile.TemporaryDirectory(prefix="populora-eval-") as workdir:
        out_path = os.path.join(workdir, "results.jsonl")
        job = {
            "mode": mode,
            "code": code,
            "entry_point": entry_point,
            "inputs": inputs,
            "deserialize": deserialize,
            "task_id": task_id,
            "time_limits": time_limits,
            "exec_timeout": limits.exec_timeout_s,
            "stop_on_error": stop_on_error,
            "memory_mb": limits.memory_mb,
            "cpu_s": wall_timeout_s + 2,
            "fsize_mb": limits.max_result_mb,
            "out_path": out_path,
        }
        job_path = os.path.join(workdir, "job.json")
        with open(job_path, "w", encoding="utf-8") as f:
            json.dump(job, f)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", str(HARNESS), job_path],
            cwd=workdir,
            env=_child_env(workdir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        error = None
        try:
            proc.wait(timeout=wall_timeout_s)
        except subprocess.TimeoutExpired:
            error = f"timeout: the task exceeded {wall_timeout_s:.1f}s"
        finally:
            # Kill the group even after a normal exit: the candidate may have left children behind.
            _kill_group(proc)
        rows = _read_rows(out_path, limits.max_result_mb * 1024 * 1024)
        if rows and "stage" in rows[0]:
            return RunOutcome([], f"{rows[0]['stage']}: {rows[0].get('e', '')}")
        if error is None and proc.returncode not in (0, -signal.SIGKILL) and len(rows) < len(inputs):
            error = f"crashed with exit code {proc.returncode}"
        if error is None and len(rows) < len(inputs) and (not rows or rows[-1].get("s") == "ok"):
            error = "the harness stopped early (memory or CPU limit?)"
        return RunOutcome(rows, error)


def _read_rows(path: str, max_bytes: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        size = os.path.getsize(path)
    except OSError:
        return rows
    if size > max_bytes:
        return rows
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                break  # a line cut short by a kill or the size limit
            if not isinstance(row, dict):
                break
            rows.append(row)
    return rows
