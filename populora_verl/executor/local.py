"""Local sandbox backend: pre-started worker processes (``_runner.py``) inside Linux namespaces.

Each slot is one long-lived runner started as ``unshare --pid --net --mount --ipc --uts ... python -s -S -P -B
_runner.py`` with a clean environment. The runner is PID 1 of its own PID namespace, has no network, sees a
read-only filesystem with a private /tmp, /proc and /dev and no /sys, and has its zygote (an exec'd interpreter
that never sees a request) fork one child per program, in the run's own pid and time namespaces, that applies rlimits
and drops to the slot's own unprivileged uid (uid 1000 inside the slot's user namespace, the
same in every slot). Where namespaces are forbidden (containers) the same runner runs without them and the
missing protections are reported as off.
"""

from __future__ import annotations

import functools
import itertools
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
from populora_verl.executor._runner import _HDR, WipeError, _read_exact, wipe_dir

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
        return (
            subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=15,
                env=WORKER_ENV,
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
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

    def __init__(
        self, slot: int, plan: SandboxPlan, settings: dict, uid_base: int, cgroups: MemoryCgroups | None = None
    ) -> None:
        self.slot, self.plan, self.settings = slot, plan, settings
        self.uid = uid_base + slot if plan.uid_drop else None
        self.cgroups = cgroups
        self.proc: subprocess.Popen | None = None
        self.protections: dict[str, bool] = {}
        self.notes: list[str] = []
        self.workdirs: list[str] = []
        self.restarts = 0

    def start(self) -> None:
        cmd = [*self.plan.launcher, sys.executable, "-s", "-S", "-P", "-B", RUNNER]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=WORKER_ENV,
            cwd="/",
            start_new_session=True,
            close_fds=True,
        )
        cgroup = self.cgroups.slot_dir(self.slot) if self.cgroups is not None else None
        if cgroup is not None:
            self.cgroups.set_limit(self.slot, 1 << 62)  # no limit while the runner starts (restarts too)
        cfg = dict(
            self.settings,
            uid=self.uid,
            gid=self.uid,
            setup_mounts=self.plan.namespaces != "none",
            expose=[os.path.dirname(os.__file__)],
            hide=self.settings.get("hide", default_hidden_paths()),
            cgroup=cgroup,
            user_namespace=self.plan.namespaces == "user",
        )
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
        self.workdirs = [d for d in hello.get("workdirs", []) if _is_work_folder(d)]
        if self.protections.get("memory_cgroup"):
            try:  # the runner's own footprint (interpreter, warm imports) plus what one call may use
                limit = self.cgroups.usage(self.slot) + (int(self.settings["memory_mb"]) << 20) + (8 << 20)
                self.cgroups.set_limit(self.slot, limit)
            except OSError as e:
                self.protections["memory_cgroup"] = False
                self.notes.append(f"memory cgroup limit: {e}")

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        data = _HDR.pack(len(data)) + data
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def _recv(self, deadline: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        hdr = _read_exact(fd, _HDR.size, deadline)
        if hdr is None:
            return None
        body = _read_exact(fd, _HDR.unpack(hdr)[0], deadline)
        return None if body is None else json.loads(body)

    def call(self, reqs: list[dict], grace_s: float) -> list[dict]:
        """Run a batch of requests in order; a slot that dies, hangs or reports a failure of its own is
        replaced, and the requests it did not answer report the failure."""
        start = time.monotonic()
        reply = None
        try:
            if self.proc is None or self.proc.poll() is not None:
                self.restart()
            self._send({"batch": reqs})
            # Two runs per request share one time budget; the grace covers forks, cleanup and I/O.
            budget = sum(float(r["timeout_s"]) for r in reqs) + grace_s * max(1, len(reqs) // 8 + 1)
            reply = self._recv(start + budget)
            if reply is not None and (not isinstance(reply.get("batch"), list) or len(reply["batch"]) != len(reqs)):
                reply = None
        except (OSError, ValueError, RuntimeError, TypeError) as e:
            logger.warning("executor worker %d failed: %s", self.slot, e)
        if reply is None or reply.get("fatal"):
            if reply is not None:
                logger.warning("executor worker %d: %s", self.slot, reply["fatal"])
            try:
                self.restart()
            except RuntimeError as e:
                logger.error("%s", e)
            if reply is not None:
                return reply["batch"]
            return [
                {
                    "ok": False,
                    "output": None,
                    "error": "crashed: sandbox worker died (restarted)",
                    "duration_s": time.monotonic() - start,
                }
                for _ in reqs
            ]
        return reply["batch"]

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
        # Without a private /tmp the runner's work folders are in the host's: they go with the runner.
        for path in self.workdirs:
            try:
                wipe_dir(path)
                os.rmdir(path)
            except (OSError, WipeError) as e:
                logger.warning("executor worker %d: cannot remove %s: %s", self.slot, path, e)
        self.workdirs = []


_INSTANCES = itertools.count()


def default_hidden_paths() -> list[str]:
    """What the sandbox covers with an empty folder: the trainer's working directory and home, where run
    folders (buffers, hidden golds) are written."""
    paths = [os.getcwd(), os.path.expanduser("~")]
    return list(dict.fromkeys(os.path.realpath(p) for p in paths if p and os.path.isabs(p)))


def _is_work_folder(path: str) -> bool:
    """Whether ``path``, named by a runner, is one of the work folders runners make (nothing else is removed)."""
    import tempfile

    return (
        isinstance(path, str)
        and os.path.dirname(path) == tempfile.gettempdir()
        and os.path.basename(path).startswith("populora_exec_")
    )


def default_uid_base() -> int:
    """A uid range per executor (process id and instance number), so that two executors, in one process or
    not, never share a slot uid: kill(-1), RLIMIT_NPROC and the user keyring are per uid."""
    return UID_BASE + ((os.getpid() * 61 + next(_INSTANCES)) % 1_000_000) * MAX_SLOTS


def _own_cgroup(controller: str) -> tuple[str, str] | None:
    """(version, directory) of this process's cgroup holding ``controller`` (v1) or the unified one (v2)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = [ln.rstrip("\n").split(":", 2) for ln in fh]
    except OSError:
        return None
    for _, ctrls, path in lines:
        if controller in ctrls.split(","):
            root = f"/sys/fs/cgroup/{controller}"
            return ("v1", root + path) if os.path.isdir(root + path) else None
    for _, ctrls, path in lines:
        if ctrls == "":
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                if os.path.exists(f"{root}/cgroup.controllers") and os.path.isdir(root + path):
                    return "v2", root + path
    return None


class MemoryCgroups:
    """One memory cgroup per slot under this process's own, capping everything a call's processes use:
    anonymous memory, memfd/tmpfs pages and SysV shared memory alike (RLIMIT_AS sees only the first).

    The runner joins its slot's group at start; the limit is then set to the runner's own footprint plus
    ``memory_mb``. Where the host does not allow it (no root, no memory controller) ``error`` says why and
    the executor runs without it (RLIMIT_AS per process; SysV objects still removed after each run).
    """

    def __init__(self, num_slots: int) -> None:
        self.version: str | None = None
        self.dir: str | None = None
        self.error: str | None = None
        found = _own_cgroup("memory")
        if found is None:
            self.error = "no writable memory cgroup hierarchy"
            return
        version, base = found
        path = os.path.join(base, f"populora-exec-{os.getpid()}-{next(_INSTANCES)}")
        try:
            os.mkdir(path)
            if version == "v2":
                with open(os.path.join(base, "cgroup.subtree_control")) as fh:
                    if "memory" not in fh.read().split():
                        raise OSError("memory controller not enabled for child cgroups")
            for i in range(num_slots):
                os.mkdir(self.slot_dir_of(path, i))
        except OSError as e:
            self.error = f"cannot create memory cgroups under {base}: {e}"
            self._remove(path, num_slots)
            return
        self.version, self.dir, self.num_slots = version, path, num_slots

    @staticmethod
    def slot_dir_of(path: str, slot: int) -> str:
        return os.path.join(path, f"slot{slot}")

    def slot_dir(self, slot: int) -> str | None:
        return None if self.dir is None else self.slot_dir_of(self.dir, slot)

    def usage(self, slot: int) -> int:
        name = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        with open(os.path.join(self.slot_dir(slot), name)) as fh:
            return int(fh.read())

    def set_limit(self, slot: int, limit: int) -> None:
        d = self.slot_dir(slot)
        if self.version == "v1":
            files = [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)]
        else:
            files = [("memory.max", limit), ("memory.swap.max", 0)]
        for name, value in files:
            try:
                with open(os.path.join(d, name), "w") as fh:
                    fh.write(str(value))
            except FileNotFoundError:
                continue  # no swap accounting on this host: nothing to cap there
            except OSError:
                # memsw must stay >= limit: raising the limit first fails when memsw is lower; retry after
                if name == "memory.limit_in_bytes":
                    with open(os.path.join(d, "memory.memsw.limit_in_bytes"), "w") as fh:
                        fh.write(str(limit))
                    with open(os.path.join(d, name), "w") as fh:
                        fh.write(str(value))
                else:
                    raise

    @staticmethod
    def _remove(path: str, num_slots: int) -> None:
        for i in range(num_slots):
            try:
                os.rmdir(MemoryCgroups.slot_dir_of(path, i))
            except OSError:
                pass
        try:
            os.rmdir(path)
        except OSError:
            pass

    def close(self) -> None:
        if self.dir is not None:
            self._remove(self.dir, self.num_slots)
            self.dir = None


class LocalBackend:
    """A pool of sandbox workers, one per slot, handed out to calling threads."""

    name = "local"

    def __init__(
        self,
        *,
        num_workers: int,
        settings: dict,
        isolation: str = "auto",
        grace_s: float = 5.0,
        uid_base: int | None = None,
        memory_cgroup: bool = True,
    ) -> None:
        if not 1 <= num_workers <= MAX_SLOTS:
            raise ValueError(f"num_workers must be in [1, {MAX_SLOTS}], got {num_workers}")
        self.plan = detect_sandbox(isolation)
        self.grace_s = grace_s
        base = default_uid_base() if uid_base is None else uid_base
        # Only a root runner can join a cgroup the host made (a user-namespace root is not root here).
        self.cgroups = None
        cgroup_note = None
        if not memory_cgroup:
            cgroup_note = "memory cgroup disabled by memory_cgroup=False"
        elif os.geteuid() != 0 or self.plan.namespaces == "user":
            cgroup_note = "memory cgroup needs a root runner"
        else:
            self.cgroups = MemoryCgroups(num_workers)
            if self.cgroups.dir is None:
                cgroup_note, self.cgroups = self.cgroups.error, None
        self.workers = [Worker(i, self.plan, settings, base, self.cgroups) for i in range(num_workers)]
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
        self.protections = dict(
            first.protections,
            network_namespace=self.plan.namespaces != "none",
            ipc_uts_namespaces=self.plan.namespaces != "none",
        )
        self.notes = list(self.plan.notes) + list(first.notes)
        if cgroup_note:
            self.notes.append(
                cgroup_note + ": a call's memory is capped by RLIMIT_AS only (SysV shared memory "
                "is removed after each run)"
            )

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def run(self, req: dict) -> dict:
        return self.run_batch([req])[0]

    def run_batch(self, reqs: list[dict]) -> list[dict]:
        """Requests in one round trip to one slot (in order); fewer host/runner wake-ups per program."""
        with self._cond:
            while not self._idle:
                self._cond.wait()
            worker = self._idle.pop()
        try:
            return worker.call(reqs, self.grace_s)
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
        if self.cgroups is not None:
            self.cgroups.close()
