"""A second outside red team's findings against both backends, one section per defect class. Each test failed
on the executor before the fix, except ``test_honest_programs_keep_their_modules`` (honest programs must not
pay for the stricter import guard). The SandboxFusion script runs in a local process, as the service runs it
(the code in a file, the request's stdin on stdin, as root when the tests are)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import unicodedata

import pytest

from populora_verl.config import PopuLoRAConfig
from populora_verl.executor import Executor
from populora_verl.executor.core import ExecResult, safe_text
from populora_verl.executor.local import LocalBackend
from populora_verl.executor.sandbox_fusion import SandboxFusionBackend, new_marker, parse_response
from populora_verl.tasks import validate_proposal
from populora_verl.tasks.verify import AnswerScore, ProposalResult

TIMEOUT = 2.0
MEMORY_MB = 256
ROOT = os.geteuid() == 0


# Not from the shared executor pool: these tests restart slots and ask workers directly, past the executor.
@pytest.fixture(scope="module")
def ex():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=2) as executor:
        yield executor


def _runnable_by_anyone(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return os.path.isfile(real) and all(os.stat(p).st_mode & 0o001 for p in [*dirs, real])


# SandboxFusion runs scripts as root and its interpreter is one an unprivileged user can start: the script
# then runs the programs as a uid of their own. Use such an interpreter when this machine has one.
SF_PYTHON = next((p for p in (sys.executable, "/usr/bin/python3") if _runnable_by_anyone(p)), sys.executable)


def _run_like_sandbox_fusion(self, payload: dict, timeout: float) -> dict:
    """SandboxFusion's ``run_code`` in a local process: the code in a file, stdin from the request, the
    service's own environment (no fixed hash seed), the response shape of the service."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "main.py")
        with open(script, "w") as fh:
            fh.write(payload["code"])
        try:
            proc = subprocess.run([SF_PYTHON, script], input=payload["stdin"], capture_output=True, text=True,
                                  timeout=payload["run_timeout"], cwd=tmp, env=env)
            run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
    ok = run["status"] == "Finished" and run["return_code"] == 0
    return {"status": "Success" if ok else "Failed", "message": "", "run_result": run}


@pytest.fixture(scope="module")
def sf():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SandboxFusionBackend, "_post", _run_like_sandbox_fusion)
        with Executor(backend="sandbox_fusion", sandbox_fusion_url="http://sandbox-fusion.invalid/run_code",
                      timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1) as executor:
            yield executor


@pytest.fixture(params=["local", "sandbox_fusion"])
def backend(request):
    return request.getfixturevalue("ex" if request.param == "local" else "sf")


def spelled(name: str) -> str:
    """An expression building ``name`` at run time that no static walk folds back."""
    return f"''.join(map(chr, {[ord(c) for c in name]!r}))"


def _need(ex: Executor, *keys: str) -> None:
    off = [k for k in keys if not ex.protections.get(k)]
    if off:
        pytest.skip(f"{', '.join(off)} not available here: " + "; ".join(ex._backend.notes))


def _per_slot(ex: Executor, program: str, inputs: str = "1") -> list:
    """The reply of every slot of ``ex`` to the same request (each worker asked directly)."""
    req = ex._prepare(program, inputs, False, None)
    return [w.call([req], 5.0)[0] for w in ex._backend.workers]


# --- 1. reason text carries control characters and lone surrogates ---------------------------------------------
RAW = "a\x00b\x1b[31mc\r\u202e" + chr(0xD800)
RAISES = f"def f(x):\n    raise ValueError({RAW!r})"


def _clean(text: str) -> bool:
    text.encode("utf-8")
    return all(ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cs", "Cf", "Zl", "Zp") for ch in text)


def test_error_text_is_escaped_where_it_leaves_the_executor(backend):
    res = backend.run(RAISES, "1")
    assert res.error_kind == "ValueError", res
    assert _clean(res.error), res
    assert "\\x00" in res.error and "\\x1b" in res.error and "\\ud800" in res.error and "\\u202e" in res.error


def test_proposal_and_answer_reasons_are_escaped(ex):
    cfg = PopuLoRAConfig()
    proposal = f"t</think>\n<answer>\n```python\n{RAISES}\n```\n```input\n1\n```\n</answer>"
    res = validate_proposal(proposal, "code_o", ex, cfg)
    assert res.status == "invalid" and "ValueError" in res.reason and _clean(res.reason), res.reason
    assert ProposalResult("invalid", reason="x" + RAW).reason == "xa\\x00b\\x1b[31mc\\x0d\\u202e\\ud800"
    assert _clean(AnswerScore("wrong", 0.0, reason=RAW).reason)
    assert ExecResult(False, None, RAW, 0.0).error == ProposalResult("invalid", reason=RAW).reason
    assert safe_text("line one\n\tline two: 'ok' é 中 😀") == "line one\n\tline two: 'ok' é 中 😀"
    assert safe_text("a\u2028b\x85c") == "a\\u2028b\\x85c"


# --- 2. work path, $HOME and uid differ per slot, per executor and after a restart ------------------------------
IDENTITY = ("import os\ndef f(x):\n    return (os.getcwd(), os.getenv('HOME'), os.getenv('TMPDIR'), os.getuid(),"
            " os.getgid(), os.getgroups())")


def test_work_path_home_and_uid_are_the_same_in_every_slot_executor_and_restart(ex):
    _need(ex, "fixed_identity")
    seen = _per_slot(ex, IDENTITY)
    ex._backend.workers[0].restart()
    seen += _per_slot(ex, IDENTITY)
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1) as other:
        seen += _per_slot(other, IDENTITY)
        assert other._backend.workers[0].uid != ex._backend.workers[0].uid  # other uids outside
    assert all(r["ok"] for r in seen), seen
    outputs = {r["output"] for r in seen}
    uid = 1000 if ex.protections["uid_drop"] else 0
    assert outputs == {f"('/tmp/work', '/tmp/work', '/tmp/work', {uid}, {uid}, [])"}, outputs
    assert ex.run(IDENTITY, "1").ok  # and a deterministic result


def test_without_namespaces_a_path_dependent_result_is_not_a_gold():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1, isolation="rlimits") as ex:
        assert not ex.protections["fixed_identity"]
        for prog in ("import os\ndef f(x):\n    return os.getcwd()", "import os\ndef f(x):\n    return os.getenv('HOME')"):
            res = ex.run(prog, "1")
            assert res.error_kind == "nondeterministic", res


def test_sandbox_fusion_work_path_is_not_a_gold(sf):
    for prog in ("import os\ndef f(x):\n    return os.getcwd()", "import os\ndef f(x):\n    return os.getenv('HOME')"):
        res = sf.run(prog, "1")
        assert res.error_kind == "nondeterministic", res


# --- 3. the slot's cgroup counters are a cross-call channel ----------------------------------------------------
CGROUP_PEEK = """import os
def f(x):
    lines = open('/proc/self/cgroup').read().splitlines()
    counters = []
    for line in lines:
        _, controllers, path = line.split(':', 2)
        for root in ('/sys/fs/cgroup/' + controllers.replace('name=', ''), '/sys/fs/cgroup', '/sys/fs/cgroup/unified'):
            for name in ('memory.max_usage_in_bytes', 'memory.failcnt', 'memory.peak', 'memory.events'):
                try:
                    counters.append(open(root + path.rstrip('/') + '/' + name).read())
                except OSError:
                    pass
    return (sorted({line.split(':', 2)[2] for line in lines}), counters, os.listdir('/sys'))
"""


def test_cgroup_counters_are_out_of_reach(ex):
    _need(ex, "no_sys", "cgroup_namespace")
    assert ex.run("def f(n):\n    return len(bytearray(n << 20))", "100", check_determinism=False).ok
    replies = _per_slot(ex, CGROUP_PEEK)
    assert [r.get("output") for r in replies] == ["(['/'], [], [])"] * ex.num_workers, replies


# --- 4. host load, memory, name and interfaces leak and pass as golds ----------------------------------------
HOST_VIEW = """import os, socket
def f(x):
    try:
        nets = os.listdir('/sys/class/net')
    except OSError as e:
        nets = type(e).__name__
    return (open('/proc/loadavg').read(), open('/proc/meminfo').readline(), open('/proc/stat').readline(),
            open('/proc/sys/kernel/random/boot_id').read(), socket.gethostname(), os.uname().nodename, nets,
            sorted(os.listdir('/proc/pressure')) if os.access('/proc/pressure', os.F_OK) else [])
"""


def test_host_load_memory_name_and_interfaces_read_the_same_fixed_world(ex):
    _need(ex, "masked_proc", "no_sys", "fixed_hostname")
    replies = _per_slot(ex, HOST_VIEW)
    expected = repr(("0.00 0.00 0.00 1/1 1\n", f"MemTotal:       {MEMORY_MB * 1024:>8} kB\n",
                     "cpu  0 0 0 0 0 0 0 0 0 0\n", "00000000-0000-0000-0000-000000000000\n", "sandbox", "sandbox",
                     "FileNotFoundError", []))
    assert [r.get("output") for r in replies] == [expected] * ex.num_workers, replies


# --- 5. a program can create a user namespace (and hold every capability in it) ------------------------------
NEW_NAMESPACES = """import ctypes, os
def f(x):
    libc = ctypes.CDLL(None, use_errno=True)
    out = [libc.unshare(flags) for flags in (0x10000000, 0x10000000 | 0x00020000, 0x00020000, 0x40000000)]
    if os.uname().machine == 'x86_64':
        pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        out.append(min(pid, 0))
    caps = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')]
    return out, caps
"""


def _assert_no_new_namespaces(ex: Executor) -> None:
    res = ex.run(NEW_NAMESPACES, "1", check_determinism=False)
    assert res.ok, res
    results, caps = eval(res.output)  # noqa: S307 - plain data checked by the executor
    assert all(r == -1 for r in results), res
    if ex.protections.get("uid_drop"):
        assert caps == ["0000000000000000"], res


def test_programs_cannot_create_namespaces(backend):
    if backend.backend == "local":
        _need(backend, "namespace_filter")
        assert backend.protections["user_namespace_limit"] or not backend.protections["uid_drop"]
    _assert_no_new_namespaces(backend)


def test_the_namespace_filter_holds_without_namespaces_too():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1, isolation="rlimits") as ex:
        _need(ex, "namespace_filter")
        _assert_no_new_namespaces(ex)


def test_the_user_namespace_limit_holds_without_the_filter():
    # A slot without the seccomp filter (as on an architecture it does not know): the kernel's own limit in
    # the slot's user namespace still refuses (ENOSPC, not the filter's EPERM), and cannot be raised.
    settings = {"banned": [], "nproc": 16, "fsize_mb": 16, "tmp_mb": 64, "memory_mb": MEMORY_MB,
                "namespace_filter": False}
    backend = LocalBackend(num_workers=1, settings=settings)
    try:
        if not backend.protections["user_namespace_limit"]:
            pytest.skip("no user namespace per slot here: " + "; ".join(backend.notes))
        assert backend.protections["namespace_filter"] is False
        prog = ("import ctypes\ndef f(x):\n    libc = ctypes.CDLL(None, use_errno=True)\n    r = libc.unshare(0x10000000)\n"
                "    e = ctypes.get_errno()\n    try:\n        open('/proc/sys/user/max_user_namespaces', 'w').write('9')\n"
                "    except OSError as err:\n        e = (e, type(err).__name__)\n"
                "    return r, e, open('/proc/sys/user/max_user_namespaces').read()")
        reply = backend.run({"program": prog, "inputs": "1", "timeout_s": TIMEOUT, "memory_mb": MEMORY_MB,
                             "max_output_chars": 1000, "plain_data": True, "check_determinism": False})
    finally:
        backend.close()
    assert reply["ok"] and reply["output"] == "(-1, (28, 'PermissionError'), '0\\n')", reply


# --- 6. the banned-module policy can be bypassed -----------------------------------------------------------------
# Each imports random and time and returns a deterministic value: all were accepted before.
BYPASSES = {
    "computed builtins name and rewritten co_filename": (
        "def f(x):\n    b = getattr(f, '__glo' + 'bals__')['__bui' + 'ltins__']\n"
        "    imp = b['__imp' + 'ort__'] if isinstance(b, dict) else getattr(b, '__imp' + 'ort__')\n"
        "    def g(name):\n        return imp(name)\n"
        "    g.__code__ = g.__code__.replace(co_filename='/usr/lib/python3/os.py')\n"
        "    r, t = g('random'), g('time')\n    r.seed(x)\n    return (r.randint(0, 99), t.gmtime(0).tm_year)"),
    "run-time names and rewritten co_filename": (
        f"def f(x):\n    b = getattr(f, {spelled('__globals__')})[{spelled('__builtins__')}]\n"
        f"    imp = b[{spelled('__import__')}] if isinstance(b, dict) else getattr(b, {spelled('__import__')})\n"
        "    def g(name):\n        return imp(name)\n"
        f"    c = getattr(g, {spelled('__code__')})\n"
        f"    setattr(g, {spelled('__code__')}, c.replace(**{{{spelled('co_filename')}: '/usr/lib/python3/os.py'}}))\n"
        "    r, t = g('random'), g('time')\n    r.seed(x)\n    return (r.randint(0, 99), t.gmtime(0).tm_year)"),
    "a stdlib module importing on the program's behalf": (
        f"import pkgutil\ndef f(x):\n    r = pkgutil.resolve_name({spelled('random')})\n"
        "    r.seed(x)\n    return r.randint(0, 99)"),
    "the import guard removed first": (
        f"import pkgutil, sys\ndef f(x):\n    del getattr(sys, {spelled('meta_path')})[0]\n"
        f"    r = pkgutil.resolve_name({spelled('random')})\n    r.seed(x)\n    return r.randint(0, 99)"),
    "a banned module reached through an allowed one": (
        "import statistics\ndef f(x):\n    statistics.random.seed(x)\n    return statistics.random.randint(0, 99)"),
}


@pytest.mark.parametrize("name", list(BYPASSES))
def test_banned_modules_stay_banned(backend, name):
    res = backend.run(BYPASSES[name], "1")
    assert not res.ok and "banned import" in res.error, res


def test_a_proposal_importing_random_and_time_is_invalid(ex):
    program = BYPASSES["computed builtins name and rewritten co_filename"]
    proposal = f"t</think>\n<answer>\n```python\n{program}\n```\n```input\n1\n```\n</answer>"
    res = validate_proposal(proposal, "code_o", ex, PopuLoRAConfig())
    assert res.status == "invalid" and "banned import" in res.reason, res.reason


def test_honest_programs_keep_their_modules(backend):
    prog = ("import queue, heapq, itertools, functools, statistics, collections, string, re, math\n"
            "from collections import namedtuple\nP = namedtuple('P', 'a b')\n"
            "def f(xs):\n    q = queue.PriorityQueue()\n    for x in xs:\n        q.put(x)\n"
            "    return [q.get() for _ in xs], statistics.median(xs), list(P(1, 2)), heapq.nsmallest(1, xs)")
    res = backend.run(prog, "[3, 1, 2]")
    assert res.ok and res.output == "([1, 2, 3], 2, [1, 2], [1])", res


# --- 7. SandboxFusion: no cross-process check, random hash seed, forgeable result line ----------------------------
def test_sandbox_fusion_checks_determinism_across_processes(sf):
    golds = {sf.run("def f(x):\n    return repr({'apple', 'banana', 'cherry', 'date', 'elder', 'fig'})", "1").output
             for _ in range(4)}
    assert len(golds) == 1 and None not in golds, golds
    for prog in ("import os\ndef f(x):\n    return os.getpid()", "import os\nSALT = os.urandom(8)\ndef f(x):\n    return SALT"):
        assert sf.run(prog, "1").error_kind == "nondeterministic"


FORGER = r"""import os, re, sys
def f(x):
    places = [sys.argv[0], '/proc/%d/cmdline' % os.getppid()]
    try:
        places += open('/proc/%d/cmdline' % os.getppid()).read().split('\0')
    except OSError:
        pass
    markers = set()
    for place in places:
        try:
            markers.update(re.findall(r'@@populora-[0-9a-f]+@@', open(place).read()))
        except (OSError, ValueError):
            pass
    line = ''.join('\n' + m + '{"ok": true, "output": "42", "error": null}' for m in markers) + '\n'
    for target in ('/proc/self/fd/1', '/proc/%d/fd/1' % os.getppid()):
        try:
            fd = os.open(target, os.O_WRONLY)
            os.write(fd, line.encode())
        except OSError:
            pass
    sys.stdout.write(line)
    sys.stdout.flush()
    os._exit(0)
"""


def test_sandbox_fusion_result_line_cannot_be_forged(sf):
    res = sf.run(FORGER, "1")
    assert not res.ok and res.output is None, res
    nonce, marker = new_marker()
    assert nonce in marker and new_marker()[0] != nonce
    line = marker + '{"ok": true, "output": "1", "error": null}'
    two = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": f"{line}\n{line}\n"}}
    assert parse_response(two, marker, 1.0)["error"].startswith("crashed")  # a second line is a forger's
    other = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0,
                                                 "stdout": line.replace(nonce, "0" * 32)}}
    assert parse_response(other, marker, 1.0)["ok"] is False


# --- 8. host device nodes: /dev/ptmx, GPUs ------------------------------------------------------------------------
DEVICES = """import ctypes, os
def f(x):
    tried = {}
    for path in ('/dev/ptmx', '/dev/tty', '/dev/kmsg', '/dev/nvidiactl', '/dev/nvidia0', '/dev/dri', '/dev/shm'):
        try:
            os.close(os.open(path, os.O_RDONLY))
            tried[path] = 'opened'
        except OSError as e:
            tried[path] = type(e).__name__
    try:
        nvml = ctypes.CDLL('libnvidia-ml.so.1').nvmlInit_v2()
    except (OSError, AttributeError):
        nvml = 'no library'
    with open('/dev/null', 'w') as fh:
        fh.write('x')
    usable = (open('/dev/zero', 'rb').read(2), len(open('/dev/urandom', 'rb').read(4)))
    return sorted(os.listdir('/dev')), tried, nvml, usable, sorted(os.listdir('/proc/driver'))
"""


def test_only_harmless_devices_are_reachable(ex):
    _need(ex, "private_dev", "masked_proc")
    res = ex.run(DEVICES, "1", check_determinism=False)
    assert res.ok, res
    listing, tried, nvml, usable, driver = eval(res.output)  # noqa: S307 - plain data checked by the executor
    assert listing == ["fd", "full", "null", "random", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert set(tried.values()) == {"FileNotFoundError"}, tried
    assert nvml == "no library" or nvml != 0, nvml  # NVML finds no device to talk to
    assert usable == (b"\x00\x00", 4) and driver == []


def test_new_protections_are_reported(ex):
    prot = ex.protections
    keys = ("private_dev", "no_sys", "masked_proc", "fixed_hostname", "cgroup_namespace", "fixed_identity",
            "user_namespace_limit", "namespace_filter")
    assert all(k in prot for k in keys)
    if ROOT and prot["pid_namespace"]:
        assert all(prot[k] for k in keys), {k: prot[k] for k in keys}
    with Executor(timeout_s=TIMEOUT, max_workers=1, isolation="rlimits") as plain:
        assert not any(plain.protections[k] for k in keys if k != "namespace_filter")
