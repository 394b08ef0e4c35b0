"""Remote backend: SandboxFusion's ``run_code`` HTTP API (the service verl's ``sandbox_fusion`` reward uses).

Each evaluation is one self-contained Python script, a supervisor: it runs ``f(<inputs>)`` in a fresh
interpreter process (which also calls ``f`` twice, as AZR does) and, for the determinism check, once more in
a second, independent process; both with the hash seed fixed, a clean environment, a work directory and (where
the service allows a mount namespace) a /tmp of their own, a uid of their own when the service runs as root,
the runtime import guard and the namespace filter of the local backend, and no handle on the supervisor's
output. Whatever a run started is killed by its uid and by descent (the supervisor is a subreaper), setsid or not. The
supervisor compares the two results and prints one JSON line behind a marker whose
secret half, a per-call nonce, reaches it on stdin and never appears in the script (which the program can
read). The response's ``run_result`` is mapped onto the executor's result; the banned-module check runs
locally before anything is sent, and the host checks every reply again (size, plain data).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import secrets
import string
import time
import urllib.error
import urllib.request

from populora_verl.executor import _runner

logger = logging.getLogger(__name__)

MARKER_PREFIX = "@@populora-"
# Uids the supervisor gives its runs when the service runs as root: one drawn at random per run, unused by
# any account, so that killing by uid reaches that run's processes and nothing else.
RUN_UIDS = (1 << 30, 1 << 28)

# The process that runs the program: reads its request on stdin, writes one length-prefixed JSON result to
# the descriptor named in argv, and nothing else (its stdout and stderr go nowhere).
_CHILD = """\
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import json, os, resource, struct

$banned_module_paths

$install_import_guard


def _short(e):
    try:
        m = str(e)
    except BaseException:
        m = "<unprintable>"
    t = type(e).__name__ + (": " + m if m else "")
    return t if len(t) <= 300 else t[:297] + "..."


def _evaluate(req):
    try:
        code = compile(req["program"], "<program>", "exec")
        call = compile("f(\\n" + req["inputs"] + "\\n)", "<input>", "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return {"ok": False, "output": None, "error": _short(e)}
    ns = {"__name__": "__main__"}
    cap = int(req["cap"])
    try:
        exec(code, ns)
        if not callable(ns.get("f")):
            return {"ok": False, "output": None, "error": "NameError: program defines no function f"}
        first = eval(call, ns)
        text = repr(first)
        if len(text) > cap:
            return {"ok": False, "output": None, "error": "output too large: %d chars > %d" % (len(text), cap)}
        if req["double"]:
            second = eval(call, ns)
            if type(second) is not type(first) or repr(second) != text:
                return {"ok": False, "output": None, "error": "nondeterministic: two calls gave different results"}
        return {"ok": True, "output": text, "error": None}
    except MemoryError:
        return {"ok": False, "output": None, "error": "memory: MemoryError (limit exceeded)"}
    except BaseException as e:
        return {"ok": False, "output": None, "error": _short(e)}


def _main():
    fd = int(sys.argv[1])
    req = json.loads(sys.stdin.buffer.read())
    mem = int(req["memory_mb"]) << 20
    limits = ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, int(req["cpu_s"])))
    for which, value in limits:
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    banned = list(req["banned"])
    for name in $import_before_guard:
        try:
            __import__(name)
        except ImportError:
            pass
    paths = banned_module_paths(banned)
    for m in [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned) and m != "os.path"]:
        del sys.modules[m]
    install_import_guard(banned, paths)
    data = json.dumps(_evaluate(req)).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]
    os._exit(0)


_main()
"""

_SUPERVISOR = """\
import ctypes, json, os, secrets, select, shutil, signal, struct, subprocess, sys, tempfile, time

_NONCE = sys.stdin.readline().strip()  # the marker's secret half: never in this file
_PROGRAM = $program
_INPUTS = $inputs
_CAP = $cap
_DET = $det
_TIMEOUT = $timeout
_MEMORY_MB = $memory_mb
_BANNED = $banned
_CHILD = $child
_UID_RANGE = $uid_range
_LIBC = ctypes.CDLL(None, use_errno=True)
_ROOT = os.geteuid() == 0

$install_namespace_filter


def _not_dumpable():
    # Our /proc files (memory, fds: the nonce and the real stdout) become unreadable to the programs.
    try:
        _LIBC.prctl(4, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except AttributeError:
        pass


_SIGNALS = {signal.SIGKILL: "memory: killed (SIGKILL, likely out of memory)", signal.SIGXCPU: "timeout: CPU time limit"}


def _private_tmp(workdir, owner):
    # A mount namespace of the run's own with fresh tmpfs on /tmp, /var/tmp and /dev/shm: the service's shared
    # folders are out of the run's reach, so a value the first run leaves there cannot reach the second.
    if _ROOT:
        ok = _LIBC.unshare(0x00020000) == 0
    else:
        uid, gid = os.geteuid(), os.getegid()
        ok = _LIBC.unshare(0x10000000 | 0x00020000) == 0
        if ok:
            for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
                with open("/proc/self/" + name, "w") as fh:
                    fh.write(text)
    if not ok or _LIBC.mount(None, b"/", None, (1 << 14) | (1 << 18), None) != 0:  # MS_REC | MS_PRIVATE
        raise OSError(ctypes.get_errno(), "no mount namespace")
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and _LIBC.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4, b"size=64m,mode=1777") != 0:
            if d == "/tmp":
                raise OSError(ctypes.get_errno(), "no tmpfs on /tmp")
    os.makedirs(workdir, 0o700)
    if owner is not None:
        os.chown(workdir, owner, owner)
    os.chdir(workdir)


def _confine(workdir, owner, private):
    # Runs in the program's process before the interpreter starts: its own /tmp, then its own uid (root), then
    # the namespace filter (after the mounts, which need a new namespace).
    if private:
        _private_tmp(workdir, owner)
    else:
        os.chdir(workdir)
    if owner is not None:
        os.setgroups([])
        os.setresgid(owner, owner, owner)
        os.setresuid(owner, owner, owner)
    install_namespace_filter()


def _probe_private_tmp():
    pid = os.fork()
    if pid == 0:
        try:
            _private_tmp("/tmp/populora_probe", None)  # made inside the probe's own /tmp only
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


$process_descendants

def _kill_run(owner):
    # Everything the run started dies: by its uid where it has one of its own (kill(-1) as that uid reaches
    # exactly its processes), and by descent from us in every case; then reaped, so nothing outlives the call.
    for _ in range(100):
        if owner is not None:
            helper = os.fork()
            if helper == 0:
                try:
                    os.setresuid(owner, owner, owner)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(helper, 0)
        left = process_descendants()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not left:
            return


def _once(double, deadline, private):
    workdir = tempfile.mkdtemp(prefix="populora_")
    os.chmod(workdir, 0o700)
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    # the base interpreter by its real path: a run's own /tmp hides one that lives under /tmp (a virtualenv there),
    # and without site (-s -S) a virtualenv adds nothing to the child anyway
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    cmd = [python, "-s", "-S", "-B", "-c", _CHILD]
    req = json.dumps({"program": _PROGRAM, "inputs": _INPUTS, "cap": _CAP, "double": double, "banned": _BANNED,
                      "memory_mb": _MEMORY_MB, "cpu_s": int(_TIMEOUT) + 1}).encode()
    r, w = os.pipe()
    proc = None
    # A uid of the run's own (root only): its processes can be told from every other run's and killed by uid.
    owner = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1]) if _ROOT else None
    if private:
        os.rmdir(workdir)  # its name only: made again inside the run's own /tmp
    try:
        while proc is None:
            if not private and owner is not None:
                os.chown(workdir, owner, owner)
            try:
                proc = subprocess.Popen(cmd + [str(w)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, pass_fds=(w,), cwd="/", env=env,
                                        start_new_session=True,
                                        preexec_fn=lambda: _confine(workdir, owner, private))
            except (PermissionError, OSError, subprocess.SubprocessError):
                if owner is None:
                    raise
                owner = None  # the interpreter is out of an unprivileged uid's reach: run as we are
        os.close(w)
        w = None
        try:
            proc.stdin.write(req)
            proc.stdin.close()
        except OSError:
            pass
        buf, limit, timed_out = b"", 8 * _CAP + 65536, False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > limit or (len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]):
                break
        try:
            proc.kill()
        except OSError:
            pass
        status = proc.wait()
        _kill_run(owner)
    finally:
        if w is not None:
            os.close(w)
        os.close(r)
        shutil.rmtree(workdir, ignore_errors=True)
    if len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
        try:
            res = json.loads(buf[4:4 + struct.unpack(">I", buf[:4])[0]])
            if res["ok"] is True and isinstance(res["output"], str):
                return {"ok": True, "output": res["output"], "error": None}
            if res["ok"] is False and isinstance(res["error"], str):
                return {"ok": False, "output": None, "error": res["error"][:300]}
        except (ValueError, KeyError, TypeError):
            pass
        return {"ok": False, "output": None, "error": "crashed: malformed result"}
    if len(buf) > limit:
        return {"ok": False, "output": None, "error": "output too large"}
    if timed_out:
        return {"ok": False, "output": None, "error": "timeout: time limit exceeded"}
    if status < 0:
        return {"ok": False, "output": None, "error": _SIGNALS.get(-status, "crashed: killed by signal %d" % -status)}
    return {"ok": False, "output": None, "error": "crashed: exited with code %d before returning" % status}


def _main():
    _not_dumpable()
    _LIBC.prctl(36, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))  # subreaper
    private = _probe_private_tmp()
    deadline = time.monotonic() + _TIMEOUT
    first = _once(_DET, deadline, private)
    if first["ok"] and _DET:
        second = _once(False, deadline, private)
        if not second["ok"]:
            if second["error"].split(":", 1)[0] in ("timeout", "memory"):
                first = second
            else:
                first = {"ok": False, "output": None,
                         "error": ("nondeterministic: a second process failed: " + second["error"])[:300]}
        elif second["output"] != first["output"]:
            first = {"ok": False, "output": None, "error": "nondeterministic: two processes gave different results"}
    first["private_tmp"] = private
    return first


_res = _main()
sys.stdout.write("\\n$marker_prefix" + _NONCE + "@@" + json.dumps(_res) + "\\n")
sys.stdout.flush()
"""


def _source(fn) -> str:
    return inspect.getsource(fn)


def build_script(
    program: str,
    inputs: str,
    *,
    check_determinism: bool,
    max_output_chars: int,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    banned: list[str] | tuple[str, ...] = (),
) -> str:
    """The Python source sent to SandboxFusion for one evaluation; it reads the marker's nonce from stdin."""
    child = string.Template(_CHILD).substitute(
        banned_module_paths=_source(_runner.banned_module_paths),
        install_import_guard=_source(_runner.install_import_guard),
        import_before_guard=repr(_runner.IMPORT_BEFORE_GUARD),
    )
    return string.Template(_SUPERVISOR).substitute(
        program=repr(program),
        inputs=repr(inputs),
        cap=int(max_output_chars),
        det=bool(check_determinism),
        timeout=float(timeout_s),
        memory_mb=int(memory_mb),
        banned=repr([str(b) for b in banned]),
        child=repr(child),
        uid_range=repr(RUN_UIDS),
        marker_prefix=MARKER_PREFIX,
        install_namespace_filter=_source(_runner.install_namespace_filter),
        process_descendants=_source(_runner.process_descendants),
    )


def new_marker() -> tuple[str, str]:
    """``(nonce, marker)`` for one call: the nonce goes to the script on stdin, the marker starts its line."""
    nonce = secrets.token_hex(16)
    return nonce, f"{MARKER_PREFIX}{nonce}@@"


def parse_response(resp: dict, marker: str, timeout_s: float) -> dict:
    """Map a SandboxFusion ``run_code`` response onto ``{ok, output, error}``.

    Exactly one line may carry the marker: a second one can only come from a forger (and then neither is
    believed)."""
    run = resp.get("run_result") or {}
    stdout = run.get("stdout") or ""
    lines = [line for line in stdout.splitlines() if line.startswith(marker)]
    if len(lines) > 1:
        return {"ok": False, "output": None, "error": "crashed: more than one result line from sandbox_fusion"}
    if lines:
        try:
            res = json.loads(lines[0][len(marker) :])
            out = {"ok": bool(res["ok"]), "output": res.get("output"), "error": res.get("error")}
            if "private_tmp" in res:  # whether the script could give each run a /tmp of its own
                out["private_tmp"] = res["private_tmp"] is True
            return out
        except (ValueError, KeyError, TypeError):
            return {"ok": False, "output": None, "error": "crashed: malformed result from sandbox_fusion"}
    api_status = resp.get("status")
    run_status = run.get("status")
    if run_status == "TimeLimitExceeded":
        return {"ok": False, "output": None, "error": f"timeout: exceeded {timeout_s:g} s (sandbox_fusion)"}
    if api_status == "SandboxError":
        return {"ok": False, "output": None, "error": f"crashed: sandbox_fusion error: {resp.get('message', '')}"[:300]}
    stderr = (run.get("stderr") or "").strip().splitlines()
    tail = stderr[-1] if stderr else ""
    if "MemoryError" in tail:
        return {"ok": False, "output": None, "error": "memory: MemoryError (limit exceeded)"}
    code = run.get("return_code")
    return {
        "ok": False,
        "output": None,
        "error": f"crashed: exited with code {code} before returning {tail}".strip()[:300],
    }


class SandboxFusionBackend:
    """Sends each evaluation to ``url`` (e.g. ``http://host:8080/run_code``); retries gateway timeouts."""

    name = "sandbox_fusion"

    def __init__(
        self,
        url: str,
        *,
        num_workers: int,
        max_retries: int = 3,
        retry_delay_s: float = 1.0,
        request_timeout_s: float = 30.0,
        banned: list[str] | tuple[str, ...] = (),
    ) -> None:
        if not url:
            raise ValueError("sandbox_fusion backend needs a URL (executor.sandbox_fusion_url)")
        self.url = url
        self.num_workers = num_workers
        self.banned = [str(b) for b in banned]
        self.max_retries, self.retry_delay_s, self.request_timeout_s = max_retries, retry_delay_s, request_timeout_s
        self.protections = {
            "remote_sandbox": True,
            "cross_process_determinism": True,
            "fixed_hash_seed": True,
            "private_result_channel": True,
        }
        self.notes = [
            f"programs run remotely at {url}; each run gets a /tmp of its own only where the service "
            "lets the script make a mount namespace (root or user namespaces): elsewhere determinism "
            "through files in the service's /tmp is not checked (warned on the first such reply)"
        ]
        self._warned_shared_tmp = False

    def _post(self, payload: dict, timeout: float) -> dict:
        data = json.dumps(payload).encode()
        last = "no attempt"
        for attempt in range(self.max_retries):
            req = urllib.request.Request(
                self.url,
                data=data,
                method="POST",
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
                if e.code not in (502, 503, 504):
                    break
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = str(e)
            if attempt + 1 < self.max_retries:
                time.sleep(self.retry_delay_s * (attempt + 1))
        raise ConnectionError(last)

    def run(self, req: dict) -> dict:
        start = time.monotonic()
        nonce, marker = new_marker()
        timeout = float(req["timeout_s"])
        code = build_script(
            req["program"],
            req["inputs"],
            check_determinism=req["check_determinism"],
            max_output_chars=req["max_output_chars"],
            timeout_s=timeout,
            memory_mb=int(req["memory_mb"]),
            banned=self.banned,
        )
        # The supervisor enforces ``timeout`` on the program (both runs); the second on top is its own.
        payload = {
            "code": code,
            "stdin": nonce + "\n",
            "language": "python",
            "compile_timeout": 10,
            "run_timeout": max(1, math.ceil(timeout)) + 1,
            "memory_limit_MB": int(req["memory_mb"]),
            "files": {},
            "fetch_files": [],
        }
        try:
            resp = self._post(payload, timeout + 1 + self.request_timeout_s)
            res = parse_response(resp, marker, timeout)
            if res.get("private_tmp") is False and not self._warned_shared_tmp:
                self._warned_shared_tmp = True
                logger.warning(
                    "sandbox_fusion at %s: the service gives the script no mount namespace, so both runs "
                    "of a call share its /tmp: determinism through files there is not checked",
                    self.url,
                )
        except ConnectionError as e:
            res = {"ok": False, "output": None, "error": f"crashed: sandbox_fusion request failed: {e}"[:300]}
        res["duration_s"] = time.monotonic() - start
        return res

    def close(self) -> None:
        pass
