"""Local sandbox backend: pre-started worker processes (``_runner.py``) inside Linux namespaces.

Each slot is one long-lived runner started as ``unshare --pid --net --mount --ipc --uts ... python -s -S -P -B
_runner.py`` with a clean environment. The runner is PID 1 of its own PID namespace, has no network, sees a
read-only filesystem with a private /tmp and /proc, and forks one child per program that applies rlimits and
drops to the slot's own unprivileged uid. Where namespaces are forbidden (containers) the same runner runs
without them and the missing protections are reported as off.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

# The wire format and its reader are the runner's (one definition for both ends of the pipe).
from populora_verl.executor._runner import _HDR, _read_exact

logger = logging.getLogger(__name__)

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runner.py")
_NS_FLAGS = ["--pid", "--fork", "--kill-child", "--net", "--mount", "--ipc", "--uts", "--propagation", "private"]
# The runner gets nothing from our environment: no secrets, no PYTHONPATH, fixed hash seed so that the
# repr of a set of strings is the same in every worker and every run.
WORKER_ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
UID_BASE = 1_000_000
MAX_SLOTS = 256


@dataclass(frozen=True)
class SandboxPlan:
    """How workers are launched on this machine, decided once by probing."""

    launcher: tuple[str, ...]  # command prefix before the interpreter
    namespaces: str  # "root" (full), "user" (unprivileged user namespace) or "none"
    uid_drop: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


def _probe(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=15, env=WORKER_ENV).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=None)
def detect_sandbox(isolation: str = "auto") -> SandboxPlan:
    """Probe what this machine allows. ``isolation``: auto (best available) or rlimits (no namespaces)."""
    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    notes = []
    if isolation == "auto" and unshare:
        if root and _probe([unshare, *_NS_FLAGS, "true"]):
            return SandboxPlan((unshare, *_NS_FLAGS), "root", True)
        user_ns = [unshare, "--user", "--map-root-user", *_NS_FLAGS]
        if _probe([*user_ns, "true"]):
            notes.append("unprivileged user namespace: one uid only, no per-slot uid / fork limit")
            return SandboxPlan(tuple(user_ns), "user", False, tuple(notes))
        notes.append("namespaces not permitted here: rlimits" + (" + uid drop" if root else " only"))
    elif isolation == "auto":
        notes.append("unshare not found: rlimits" + (" + uid drop" if root else " only"))
    else:
        notes.append("namespaces disabled by isolation=rlimits")
    return SandboxPlan((), "none", root, tuple(notes))


class Worker:
    """One sandbox slot: a runner process and its control pipes. Not thread-safe; the pool hands it out."""

    def __init__(self, slot: int, plan: SandboxPlan, settings: dict, uid_base: int) -> None:
        self.slot, self.plan, self.settings = slot, plan, settings
        self.uid = uid_base + slot if plan.uid_drop else None
        self.proc: subprocess.Popen | None = None
        self.protections: dict[str, bool] = {}
        self.notes: list[str] = []
        self.restarts = 0

    def start(self) -> None:
        cmd = [*self.plan.launcher, sys.executable, "-s", "-S", "-P", "-B", RUNNER]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=WORKER_ENV, cwd="/",
                                     start_new_session=True, close_fds=True)
        cfg = dict(self.settings, uid=self.uid, gid=self.uid, setup_mounts=self.plan.namespaces != "none",
                   expose=[os.path.dirname(os.__file__)])
        try:
            self._send(cfg)
            hello = self._recv(time.monotonic() + 60.0)
        except OSError:
            hello = None
        if not hello or not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"executor worker {self.slot} failed to start: {(hello or {}).get('error', 'no reply')}")
        self.protections = dict(hello["protections"])
        self.notes = list(hello.get("notes", []))

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        data = _HDR.pack(len(data)) + data
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def _recv(self, deadline: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        hdr = _read_exact(fd, _HDR.size, deadline)
        if hdr is None:
            return None
        body = _read_exact(fd, _HDR.unpack(hdr)[0], deadline)
        return None if body is None else json.loads(body)

    def call(self, req: dict, grace_s: float) -> dict:
        """Run one request; a worker that dies or hangs is replaced and the call reports the failure."""
        start = time.monotonic()
        reply = None
        try:
            if self.proc is None or self.proc.poll() is not None:
                self.restart()
            self._send(req)
            reply = self._recv(start + float(req["timeout_s"]) + grace_s)
        except (OSError, ValueError, RuntimeError) as e:
            logger.warning("executor worker %d failed: %s", self.slot, e)
        if reply is None:
            try:
                self.restart()
            except RuntimeError as e:
                logger.error("%s", e)
            return {"ok": False, "output": None, "error": "crashed: sandbox worker died (restarted)",
                    "duration_s": time.monotonic() - start}
        return reply

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # launcher + runner; the PID namespace dies with its init
        except (ProcessLookupError, PermissionError):
            pass
        self._reap()

    def close(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()  # EOF: the runner leaves its loop and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def _reap(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            logger.error("executor worker %d did not exit after SIGKILL", self.slot)
        self.proc = None


def default_uid_base() -> int:
    """Per-process uid range so that two executors on one host never share a slot uid (kill/NPROC scope)."""
    return UID_BASE + (os.getpid() % 100_000) * MAX_SLOTS


class LocalBackend:
    """A pool of sandbox workers, one per slot, handed out to calling threads."""

    name = "local"

    def __init__(self, *, num_workers: int, settings: dict, isolation: str = "auto", grace_s: float = 5.0,
                 uid_base: int | None = None) -> None:
        if not 1 <= num_workers <= MAX_SLOTS:
            raise ValueError(f"num_workers must be in [1, {MAX_SLOTS}], got {num_workers}")
        self.plan = detect_sandbox(isolation)
        self.grace_s = grace_s
        base = default_uid_base() if uid_base is None else uid_base
        self.workers = [Worker(i, self.plan, settings, base) for i in range(num_workers)]
        errors: list[BaseException] = []

        def boot(w: Worker) -> None:
            try:
                w.start()
            except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=boot, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.close()
            raise errors[0]
        self._idle: list[Worker] = list(self.workers)
        self._cond = threading.Condition()
        first = self.workers[0]
        self.protections = dict(first.protections, network_namespace=self.plan.namespaces != "none",
                                ipc_uts_namespaces=self.plan.namespaces != "none")
        self.notes = list(self.plan.notes) + list(first.notes)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def run(self, req: dict) -> dict:
        with self._cond:
            while not self._idle:
                self._cond.wait()
            worker = self._idle.pop()
        try:
            return worker.call(req, self.grace_s)
        finally:
            with self._cond:
                self._idle.append(worker)
                self._cond.notify()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]

    def close(self) -> None:
        threads = [threading.Thread(target=w.close) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
