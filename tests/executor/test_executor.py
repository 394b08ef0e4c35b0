"""Executor behaviour on ordinary programs: outputs, ordering, timeouts, lifecycle, config, degraded mode and the
SandboxFusion request/response mapping (against a local fake server)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from populora_verl.config import ExecutorConfig
from populora_verl.executor import AZR_BANNED, ExecResult, Executor, check_program, truncate_middle
from populora_verl.executor.sandbox_fusion import build_script, parse_response


@pytest.fixture(scope="module")
def ex(executor_pool):
    return executor_pool.get(timeout_s=2.0, memory_mb=256, max_workers=2)


CASES = [
    ("def f(s, n):\n    return s * n", "'abc', 3", "'abcabcabc'"),
    ("def f(xs):\n    return sorted(xs, key=lambda x: (-x, x))", "[3, 1, 2]", "[3, 2, 1]"),
    ("def f(d):\n    return {k: v * 2 for k, v in sorted(d.items())}", "{'b': 2, 'a': 1}", "{'a': 2, 'b': 4}"),
    ("def f(n):\n    if n < 2:\n        return n\n    return f(n - 1) + f(n - 2)", "15", "610"),
    ("from collections import Counter\ndef f(s):\n    return Counter(s).most_common(2)", "'banana'",
     "[('a', 3), ('n', 2)]"),
    ("def f(x):\n    return x / 3", "1", "0.3333333333333333"),
    ("def f(a, b=2, *, c=3):\n    return (a, b, c)", "1, c=5", "(1, 2, 5)"),
    ("def f(s):\n    return {w for w in s.split()}", "'b a b'", "{'a', 'b'}"),  # fixed hash seed: stable order
    ("import math\nfrom functools import reduce\ndef f(xs):\n    return reduce(math.gcd, xs)", "[12, 18, 30]", "6"),
    ("class Node:\n    def __init__(self, v):\n        self.v = v\ndef f(v):\n    return Node(v).v + 1", "41", "42"),
    ("def f(s):\n    return s[::-1].upper(), len(s)", "'héllo'", "('OLLÉH', 5)"),
    ("def f(x):\n    return None", "[1,\n 2]  # AZR inputs may carry comments", "None"),
]


@pytest.mark.parametrize("program,inputs,expected", CASES)
def test_normal_programs_give_repr(ex, program, inputs, expected):
    res = ex.run(program, inputs)
    assert isinstance(res, ExecResult)
    assert res.ok, res
    assert res.output == expected
    assert res.error is None and res.error_kind is None
    assert 0 < res.duration_s < 2


@pytest.mark.parametrize("program,inputs,kind", [
    ("def f(x):\n    raise ValueError('bad value')", "1", "ValueError"),
    ("def f(x):\n    return x +", "1", "SyntaxError"),
    ("def g(x):\n    return x", "1", "NameError"),
    ("def f(x):\n    return x", "1, 2", "TypeError"),
    ("def f(x):\n    return x", "1)", "SyntaxError"),
    ("def f(x):\n    return 1 / 0", "1", "ZeroDivisionError"),
])
def test_errors_are_results(ex, program, inputs, kind):
    res = ex.run(program, inputs)
    assert not res.ok and res.output is None
    assert res.error_kind == kind, res


def test_bad_request_types(ex):
    assert ex.run(None, "1").error_kind == "bad request"  # type: ignore[arg-type]
    assert ex.run("def f(x):\n    return x", "1\x00").error_kind == "bad request"


def test_error_message_names_exception(ex):
    res = ex.run("def f(x):\n    raise KeyError('missing-key')", "1")
    assert res.error == "KeyError: 'missing-key'"


def test_run_many_keeps_order(ex):
    items = []
    for i in range(24):
        spin = 20000 * (i % 4)  # uneven durations so completion order differs from input order
        items.append((f"def f(i):\n    s = 0\n    for k in range({spin}):\n        s += k\n    return i * i", str(i)))
    results = ex.run_many(items)
    assert [r.output for r in results] == [str(i * i) for i in range(24)]


def test_run_many_runs_in_parallel(ex, monkeypatch):
    """A batch keeps both sandbox slots busy at once: the backend sees overlapping calls. Counted, not timed, so that
    a loaded machine cannot fail it (the speed itself is the executor benchmark's, BENCHMARKS.md §2)."""
    assert ex.num_workers == 2
    backend, lock, calls = ex._backend, threading.Lock(), {"active": 0, "most": 0, "requests": 0}
    name = "run_batch" if hasattr(backend, "run_batch") else "run"
    original = getattr(backend, name)

    def counted(reqs):
        with lock:
            calls["active"] += 1
            calls["most"] = max(calls["most"], calls["active"])
            calls["requests"] += len(reqs) if name == "run_batch" else 1
        try:
            return original(reqs)
        finally:
            with lock:
                calls["active"] -= 1

    monkeypatch.setattr(backend, name, counted)
    prog = "def f(x):\n    s = 0\n    for i in range(10**6):\n        s += i\n    return x"
    results = ex.run_many([(prog, str(i)) for i in range(4)])
    assert [r.output for r in results] == ["0", "1", "2", "3"] and all(r.ok for r in results)
    assert calls["requests"] == 4 and calls["most"] == 2, calls


@pytest.mark.parametrize("limit", [0.3, 1.0])
def test_timeout_respected(ex, limit):
    t = time.monotonic()
    res = ex.run("def f(x):\n    while True:\n        pass", "1", timeout_s=limit)
    wall = time.monotonic() - t
    assert res.error_kind == "timeout"
    assert limit <= res.duration_s <= limit + 0.3
    assert wall <= limit + 0.5


def test_determinism_switch_and_value_comparison(ex):
    counter = "c = [0]\ndef f(x):\n    c[0] += 1\n    return c[0]"
    assert ex.run(counter, "1").error_kind == "nondeterministic"
    assert ex.run(counter, "1", check_determinism=False).output == "1"
    judge = "def f(a, b):\n    return a == b"
    assert ex.run(judge, "{'a': [1, 2]}, {'a': [1, 2]}", check_determinism=False).output == "True"
    assert ex.run(judge, "(1, 2), [1, 2]", check_determinism=False).output == "False"


def test_mutable_inputs_are_fresh_per_call(ex):
    res = ex.run("def f(xs):\n    xs.append(1)\n    return len(xs)", "[0]")
    assert res.ok and res.output == "2"


def test_check_program_static_policy():
    assert check_program("import random\ndef f(x):\n    return x") == "banned import: random"
    assert check_program("from datetime import date\ndef f(x):\n    return x") == "banned import: datetime"
    assert check_program("import os.path\ndef f(x):\n    return x").startswith("banned import")
    assert check_program("import collections\ndef f(x):\n    return x") is None
    assert check_program("def f(x):\n    return eval('1 + 1')") is None
    assert check_program("def f(x):\n    return eval(x)").startswith("banned import")
    assert check_program("def f(x):\n    return x", banned_modules=["collections"]) is None
    assert check_program("import collections\ndef f(x):\n    return x", banned_modules=["collections"])
    assert check_program("def f(x:\n") is None  # syntax errors are reported by running


def test_configurable_banned_modules():
    with Executor(timeout_s=2, max_workers=1, banned_modules=["json"]) as ex:
        assert ex.run("import json\ndef f(x):\n    return 1", "1").error_kind == "banned import"
        res = ex.run("def f(x):\n    return __import__('random').Random(x).random() > -1", "1")
        assert res.error_kind == "banned import"  # tricks are always refused
        assert ex.run("import calendar\ndef f(x):\n    return calendar.isleap(2024)", "1").output == "True"


def test_truncation_helpers(ex):
    text = "x" * 1000
    cut = truncate_middle(text)
    assert len(cut) == 400 and "..." in cut and cut.startswith("x")
    assert truncate_middle("short") == "short"
    res = ex.run("def f(n):\n    return list(range(n))", "500")
    assert res.ok and len(res.output) > 400
    assert ex.store_output(res) == truncate_middle(res.output)


def test_from_config_and_startup_log(caplog):
    cfg = ExecutorConfig(timeout_s=1.5, memory_mb=128, max_workers=1, max_output_chars=50)
    with caplog.at_level(logging.INFO, logger="populora_verl.executor"):
        with Executor.from_config(cfg) as ex:
            assert ex.timeout_s == 1.5 and ex.memory_mb == 128 and ex.num_workers == 1
            assert ex.banned_modules == list(AZR_BANNED)
            assert ex.run("def f(n):\n    return 'y' * n", "100").error_kind == "output too large"
            assert ex.run("def f(n):\n    return 'y' * n", "10").output == repr("y" * 10)
    lines = [r.getMessage() for r in caplog.records if "active protections" in r.getMessage()]
    assert len(lines) == 1 and "rlimits" in lines[0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "State:\tZ" not in fh.read()
    except OSError:
        return False


def test_context_manager_leaves_no_processes():
    with Executor(timeout_s=2, max_workers=2) as ex:
        pids = ex._backend.worker_pids()
        uids = {w.uid for w in ex._backend.workers if w.uid is not None}
        # leave a sleeper behind mid-call to make sure shutdown still cleans up
        ex.run("def f(x):\n    import select\n    select.select([], [], [], 30)", "1", timeout_s=0.3)
        assert all(_alive(p) for p in pids)
    assert not any(_alive(p) for p in pids)
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    assert not [p for p in children.stdout.split() if int(p) in pids]
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as fh:
                    uid_line = next(line for line in fh if line.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            assert int(uid_line.split()[1]) not in uids
    with pytest.raises(RuntimeError):
        ex.run("def f(x):\n    return x", "1")


def test_degraded_mode_without_namespaces():
    with Executor(timeout_s=1.0, max_workers=1, isolation="rlimits") as ex:
        prot = ex.protections
        assert prot["pid_namespace"] is False and prot["network_namespace"] is False
        assert prot["rlimits"] is True
        assert prot["uid_drop"] is (os.geteuid() == 0)
        assert ex.run("def f(a):\n    return a[::-1]", "'abc'").output == "'cba'"
        assert ex.run("def f(x):\n    while True:\n        pass", "1", timeout_s=0.3).error_kind == "timeout"
        assert ex.run("def f(x):\n    a = []\n    while True:\n        a.append(bytearray(10**7))", "1",
                      timeout_s=10).error_kind == "memory"  # page faults are slow on a loaded VM
        if prot["fork_limit"]:
            bomb = "def f(x):\n    import os\n    while True:\n        os.fork()"
            assert not ex.run(bomb, "1", timeout_s=0.5).ok
        assert ex.run("def f(a):\n    return a + 1", "1").output == "2"


# ----------------------------------------------------------------------------- SandboxFusion
class _FakeSandbox(http.server.BaseHTTPRequestHandler):
    """Runs the submitted script with a plain interpreter (tests only send benign programs)."""

    requests: list[dict] = []
    fail_first: int = 0
    interpreter: str = sys.executable  # the service's Python

    def do_POST(self):  # noqa: N802 - http.server API
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(payload)
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(504)
            self.end_headers()
            return
        try:  # as SandboxFusion does: the code in a file, stdin from the request
            with tempfile.TemporaryDirectory() as tmp:
                script = os.path.join(tmp, "main.py")
                with open(script, "w") as fh:
                    fh.write(payload["code"])
                proc = subprocess.run([type(self).interpreter, script], input=payload["stdin"], capture_output=True,
                                      text=True, timeout=payload["run_timeout"], cwd=tmp)
            run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout,
                   "stderr": proc.stderr, "execution_time": 0.01}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        status = "Success" if run["status"] == "Finished" and run["return_code"] == 0 else "Failed"
        body = json.dumps({"status": status, "message": "", "compile_result": None, "run_result": run}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_sandbox():
    _FakeSandbox.requests = []
    _FakeSandbox.fail_first = 0
    _FakeSandbox.interpreter = sys.executable
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeSandbox)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


def test_sandbox_fusion_backend(fake_sandbox):
    cfg = ExecutorConfig(backend="sandbox_fusion", sandbox_fusion_url=fake_sandbox, timeout_s=2, memory_mb=256,
                         max_workers=2)
    with Executor.from_config(cfg) as ex:
        assert ex.protections["remote_sandbox"] is True
        assert ex.run("def f(s, n):\n    return s * n", "'ab', 2").output == "'abab'"
        req = _FakeSandbox.requests[-1]
        # The script enforces the 2 s itself (both runs) and reports; one more second is its own margin.
        assert req["language"] == "python" and req["run_timeout"] == 3 and req["memory_limit_MB"] == 256
        assert ex.run("def f(x):\n    raise ValueError('nope')", "1").error == "ValueError: nope"
        assert ex.run("c = [0]\ndef f(x):\n    c[0] += 1\n    return c[0]", "1").error_kind == "nondeterministic"
        n = len(_FakeSandbox.requests)
        assert ex.run("import random\ndef f(x):\n    return 1", "1").error_kind == "banned import"
        assert len(_FakeSandbox.requests) == n  # refused locally, never sent
        assert ex.run("def f(x):\n    import os\n    os._exit(3)", "1").error_kind == "crashed"
        assert ex.run("def f(x):\n    while True:\n        pass", "1").error_kind == "timeout"
        results = ex.run_many([("def f(a):\n    return a + 1", str(i)) for i in range(5)])
        assert [r.output for r in results] == [str(i + 1) for i in range(5)]
        _FakeSandbox.fail_first = 1
        ex._backend.retry_delay_s = 0.01
        assert ex.run("def f(a):\n    return a", "7").output == "7"  # 504 is retried


def test_sandbox_fusion_runs_a_service_python_that_lives_under_tmp(fake_sandbox):
    """A run's own /tmp hides an interpreter path under /tmp (a virtualenv there): the child must still start."""
    link_dir = tempfile.mkdtemp(prefix="populora-sf-python-", dir="/tmp")
    try:
        link = os.path.join(link_dir, "python")
        os.symlink(sys.executable, link)
        _FakeSandbox.interpreter = link
        cfg = ExecutorConfig(backend="sandbox_fusion", sandbox_fusion_url=fake_sandbox, timeout_s=2, memory_mb=256,
                             max_workers=1)
        with Executor.from_config(cfg) as ex:
            assert ex.run("def f(s, n):\n    return s * n", "'ab', 2").output == "'abab'"
    finally:
        shutil.rmtree(link_dir, ignore_errors=True)


def test_sandbox_fusion_mapping_unit():
    marker = "@@m@@"
    ok = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0,
                                              "stdout": f"noise\n{marker}" + json.dumps({"ok": True, "output": "3",
                                                                                          "error": None})}}
    assert parse_response(ok, marker, 1.0) == {"ok": True, "output": "3", "error": None}
    tle = {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": ""}}
    assert parse_response(tle, marker, 1.0)["error"].startswith("timeout")
    boom = {"status": "SandboxError", "message": "down", "run_result": None}
    assert parse_response(boom, marker, 1.0)["error"].startswith("crashed")
    oom = {"status": "Failed", "run_result": {"status": "Finished", "return_code": 1, "stdout": "",
                                              "stderr": "Traceback...\nMemoryError"}}
    assert parse_response(oom, marker, 1.0)["error"].startswith("memory")
    script = build_script("def f(x):\n    return x", "'q'", check_determinism=True, max_output_chars=10)
    compile(script, "<script>", "exec")
    assert "'q'" in script


def test_sandbox_fusion_unreachable():
    with Executor(backend="sandbox_fusion", sandbox_fusion_url="http://127.0.0.1:9/run_code", max_workers=1,
                  timeout_s=1) as ex:
        ex._backend.retry_delay_s = 0.0
        res = ex.run("def f(a):\n    return a", "1")
        assert res.error_kind == "crashed" and "sandbox_fusion" in res.error
