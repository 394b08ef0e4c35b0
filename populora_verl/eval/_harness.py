"""Child-process test harness for benchmark programs (stdlib only; run as ``python -I -B _harness.py JOB``).

This file is executed in a fresh interpreter, never imported by the evaluator: candidate code is hostile, so it
runs here, behind resource limits set before the candidate is even read, and only plain data comes back. The
parent (``populora_verl.eval.sandbox``) writes a JSON job file, waits with a wall-clock timeout, kills the whole
process group if needed, and reads the result file (size-capped by RLIMIT_FSIZE) line by line.

Job keys: ``mode`` (call | stdin | lcb_functional), ``code``, ``entry_point``, ``inputs`` (a list of argument lists,
or of stdin strings), ``deserialize`` (null | "mbpp"), ``task_id``, ``time_limits`` (seconds per input),
``exec_timeout`` (module-level code), ``stop_on_error``, ``memory_mb``, ``cpu_s``, ``fsize_mb``, ``out_path``.

Each result line is ``{"i": k, "s": "ok", "v": <encoded value>, "t": seconds}`` or
``{"i": k, "s": "timeout"|"error", "e": message}``; a value whose JSON exceeds ``digest_over_mb`` is sent as
``{"__t": "digest", "v": sha256, "n": bytes}`` (exact comparison only); a first line ``{"stage": ...}`` reports set-up
failures.
Values are encoded as JSON with tags for what JSON lacks (tuple, set, dict with any keys, bytes, complex, big
ints, other objects by repr) so the parent can rebuild them without ``eval``.
"""

import copy
import hashlib
import io
import json
import math
import os
import resource
import signal
import sys
import time

BIG_INT = 10**300
MAX_DEPTH = 200


class _Timeout(BaseException):
    """Raised by SIGALRM; a BaseException so a candidate's ``except Exception`` does not swallow it."""


def _on_alarm(signum, frame):
    raise _Timeout()


def _set_limits(job):
    mb = 1024 * 1024
    for name, value in (
        ("RLIMIT_AS", int(job["memory_mb"]) * mb),
        ("RLIMIT_DATA", int(job["memory_mb"]) * mb),
        ("RLIMIT_FSIZE", int(job["fsize_mb"]) * mb),
        ("RLIMIT_CPU", int(math.ceil(job["cpu_s"]))),
        ("RLIMIT_CORE", 0),
    ):
        limit = getattr(resource, name, None)
        if limit is None:
            continue
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass


def _disable_escape_hatches():
    """Make process-level side effects fail loudly (a guard against accidents, not a security boundary; the
    boundary is the separate process group with rlimits that the parent kills)."""
    import builtins
    import shutil
    import subprocess

    for name in (
        "kill",
        "killpg",
        "system",
        "fork",
        "forkpty",
        "putenv",
        "remove",
        "removedirs",
        "rmdir",
        "unlink",
        "rename",
        "renames",
        "replace",
        "truncate",
        "chmod",
        "chown",
        "lchown",
        "fchmod",
        "fchown",
        "chroot",
        "setuid",
        "setgid",
        "execv",
        "execve",
        "execvp",
        "execl",
        "spawnv",
        "spawnve",
        "popen",
        "posix_spawn",
        "posix_spawnp",
    ):
        if hasattr(os, name):
            setattr(os, name, None)
    shutil.rmtree = None
    shutil.move = None
    shutil.chown = None
    subprocess.Popen = None
    builtins.help = None


def _encode(value, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if type(value) is not int:  # IntEnum and friends compare as ints
            value = int(value)
        if -BIG_INT < value < BIG_INT:
            return value
        return {"__t": "hexint", "v": hex(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"__t": "float", "v": repr(float(value))}
    if isinstance(value, list):
        return [_encode(x, depth + 1) for x in value]
    if isinstance(value, tuple):
        return {"__t": "tuple", "v": [_encode(x, depth + 1) for x in value]}
    if isinstance(value, (set, frozenset)):
        tag = "set" if isinstance(value, set) else "frozenset"
        return {"__t": tag, "v": [_encode(x, depth + 1) for x in value]}
    if isinstance(value, dict):
        return {"__t": "dict", "v": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__t": "bytes", "v": bytes(value).hex()}
    if isinstance(value, complex):
        return {"__t": "complex", "v": [repr(value.real), repr(value.imag)]}
    # numpy scalars and arrays: compare like the Python values they stand for (EvalPlus compares with ==).
    if hasattr(value, "dtype") and hasattr(value, "tolist"):
        return _encode(value.tolist(), depth + 1)
    text = repr(value)
    return {"__t": "repr", "type": type(value).__name__, "v": text[:10000]}


def _short(exc):
    try:
        msg = str(exc)
    except BaseException:
        msg = "<unprintable>"
    return (type(exc).__name__ + ": " + msg)[:500]


def _mbpp_deserialize(task_id, inputs):
    """MBPP+ stores tuples, sets and complex numbers as JSON lists / strings; EvalPlus converts them back per task
    before calling. The task numbers and shapes below are the dataset's (v0.2.0) argument types."""
    n = int(str(task_id).split("/")[-1])

    def tuples(xs):
        return [tuple(x) for x in xs]

    def deep_tuple(x):
        return tuple(deep_tuple(y) for y in x) if isinstance(x, list) else x

    if n in (
        2,
        116,
        132,
        143,
        222,
        261,
        273,
        394,
        399,
        421,
        424,
        429,
        470,
        560,
        579,
        596,
        616,
        630,
        726,
        740,
        744,
        809,
    ):
        return [tuples(args) for args in inputs]  # every argument is a tuple
    if n in (63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780):
        return [[tuples(arg) for arg in args] for args in inputs]  # every argument is a list of tuples
    if n in (75, 413, 444, 753):
        return [[tuples(args[0]), args[1]] for args in inputs]
    if n in (106, 750):
        return [[args[0], tuple(args[1])] for args in inputs]
    if n == 115:  # a list of sets; EvalPlus turns an empty member into {} (a dict), kept for parity
        return [[[set(x) if isinstance(x, list) and x else {} for x in args[0]]] for args in inputs]
    if n == 124:
        return [[float(args[0]), complex(args[1])] for args in inputs]
    if n in (250, 405, 446, 617, 720, 763, 808):
        return [[tuple(args[0])] + list(args[1:]) for args in inputs]
    if n in (259, 401, 445):  # tuples of tuples
        return [[tuple(tuples(arg)) for arg in args] for args in inputs]
    if n == 278:
        return [[tuple(tuple(x) if isinstance(x, list) else x for x in args[0])] for args in inputs]
    if n == 307:
        return [[tuple(args[0]), args[1], args[2]] for args in inputs]
    if n == 722:
        return [[{k: tuple(v) for k, v in args[0].items()}] + list(args[1:]) for args in inputs]
    if n == 252:
        return [[complex(args[0])] for args in inputs]
    if n in (580, 615, 791):
        return [deep_tuple(args) for args in inputs]
    return inputs


class _Sink(io.TextIOBase):
    def write(self, s):
        return len(s) if isinstance(s, str) else 0

    def writable(self):
        return True


def _exec_module(code, exec_timeout, stdin_text=None, as_main=False):
    namespace = {"__name__": "__main__" if as_main else "__candidate__", "__builtins__": __builtins__}
    compiled = compile(code, "<candidate>", "exec")
    signal.setitimer(signal.ITIMER_REAL, max(0.01, float(exec_timeout)))
    try:
        exec(compiled, namespace)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return namespace


def main(argv):
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    _set_limits(job)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # HumanEval/83 and /139 build integers far beyond the 4300-digit default
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    out = open(job["out_path"], "w", encoding="utf-8")

    encoder = json.JSONEncoder()
    digest_over = int(job.get("digest_over_mb", 16)) * 1024 * 1024

    def emit(row):
        # Streamed, and huge values (Mbpp/255's canonical output is hundreds of MB) travel as a sha256 of their
        # encoding instead, compared exactly by the parent.
        if "v" in row:
            h, n = hashlib.sha256(), 0
            for chunk in encoder.iterencode(row["v"]):
                b = chunk.encode("utf-8")
                h.update(b)
                n += len(b)
            if n > digest_over:
                row = dict(row, v={"__t": "digest", "v": h.hexdigest(), "n": n})
        for chunk in encoder.iterencode(row):
            out.write(chunk)
        out.write("\n")
        out.flush()

    signal.signal(signal.SIGALRM, _on_alarm)
    mode = job["mode"]
    inputs = job.get("inputs") or []
    limits = job.get("time_limits") or [1.0] * len(inputs)
    stop = bool(job.get("stop_on_error", True))
    if job.get("deserialize") == "mbpp":
        try:
            inputs = _mbpp_deserialize(job.get("task_id", "Mbpp/0"), inputs)
        except Exception as e:
            emit({"stage": "deserialize", "e": _short(e)})
            return 0
    real_stdout, real_stdin = sys.stdout, sys.stdin
    sys.stdout = sys.stderr = _Sink()
    sys.stdin = io.StringIO("")
    import builtins

    real_input = builtins.input

    def _input(prompt=""):
        # builtins.input writes its prompt to the C-level stdout; go through sys.stdin instead.
        line = sys.stdin.readline()
        if not line:
            raise EOFError("EOF when reading a line")
        return line[:-1] if line.endswith("\n") else line

    builtins.input = _input
    _disable_escape_hatches()

    fn = None
    if mode in ("call", "lcb_functional"):
        try:
            ns = _exec_module(job["code"], job.get("exec_timeout", 10.0))
        except _Timeout:
            emit({"stage": "exec", "e": "timeout while running module-level code"})
            return 0
        except BaseException as e:
            emit({"stage": "exec", "e": _short(e)})
            return 0
        name = job["entry_point"]
        if mode == "lcb_functional" and isinstance(ns.get("Solution"), type):
            try:
                fn = getattr(ns["Solution"](), name, None)
            except BaseException as e:
                emit({"stage": "exec", "e": _short(e)})
                return 0
        else:
            fn = ns.get(name)
        if not callable(fn):
            emit({"stage": "exec", "e": f"entry point {name!r} is not defined"})
            return 0

    for i, raw in enumerate(inputs):
        limit = max(0.01, float(limits[i]))
        start = time.perf_counter()
        try:
            if mode == "stdin":
                captured = io.StringIO()
                sys.stdin = io.StringIO(raw)
                sys.stdout = captured
                try:
                    _exec_module(job["code"], limit, as_main=True)
                except SystemExit:
                    pass
                finally:
                    sys.stdout = _Sink()
                value = captured.getvalue()
            else:
                args = copy.deepcopy(raw)
                if not isinstance(args, (list, tuple)):
                    args = [args]
                signal.setitimer(signal.ITIMER_REAL, limit)
                try:
                    value = fn(*args)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            row = {"i": i, "s": "ok", "v": _encode(value), "t": time.perf_counter() - start}
        except _Timeout:
            row = {"i": i, "s": "timeout", "e": f"exceeded {limit:.3f}s"}
        except BaseException as e:
            row = {"i": i, "s": "error", "e": _short(e)}
        try:
            emit(row)
        except BaseException as e:  # unencodable value, or the file size limit
            emit({"i": i, "s": "error", "e": "result not serialisable: " + _short(e)})
            row = {"s": "error"}
        if row["s"] != "ok" and stop:
            break
    sys.stdout, sys.stdin = real_stdout, real_stdin
    builtins.input = real_input
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
