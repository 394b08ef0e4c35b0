"""One writer per run directory: a lock file that a second run into the same directory finds at start-up.

Two runs writing one run directory interleave their metrics, race on ``checkpoints/latest`` and leave a directory
that a later ``--resume`` silently damages further. Both engines (the CPU driver and the verl trainer's start-up
check) therefore take :func:`acquire_run_lock` on the run directory before they write anything into it, and the
second run stops with one line naming the holder.

The lock is ``<run_dir>/run.lock`` under ``fcntl.flock``: the kernel drops the lock when its process ends, however it
ends, so a run killed with SIGKILL (or a machine that rebooted) never blocks the next one. The file also records who
holds it (pid, host, start time, command) for the message; a file whose lock is free but whose record names a
process is a stale lock from a killed run, reported and taken over. Where the filesystem has no ``flock`` (some
network mounts), the record alone decides: a holder on this host that is still running keeps the lock, a holder
that is gone is stale.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["LOCK_FILE", "RunDirInUse", "RunLock", "acquire_run_lock", "claim_run_dir", "read_holder"]

LOCK_FILE = "run.lock"

log = logging.getLogger(__name__)

try:  # POSIX; on a platform without fcntl the record-only mode below is the lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class RunDirInUse(RuntimeError):
    """Another live run holds the run directory. The message is one line naming the holder."""


def read_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The lock record of ``run_dir`` (``pid``, ``host``, ``started``, ``command``), or ``None`` if there is none."""
    try:
        text = (Path(run_dir) / LOCK_FILE).read_text(encoding="utf-8")
    except OSError:
        return None
    return _parse(text)


def _parse(text: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(text) if text.strip() else None
    except ValueError:
        return {"pid": None, "host": None, "started": None, "command": text.strip()[:200]}
    return rec if isinstance(rec, dict) else None


def _describe(rec: dict[str, Any] | None) -> str:
    if not rec:
        return "another process"
    started = rec.get("started")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else ""
    )
    cmd = f" ({rec['command']})" if rec.get("command") else ""
    return f"pid {rec.get('pid')} on {rec.get('host')}{when}{cmd}"


def _alive_here(rec: dict[str, Any]) -> bool:
    """Whether the record's process is certainly or possibly alive. Another host's process cannot be checked, so it
    counts as alive: refusing is recoverable (delete the file), two writers are not."""
    if rec.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(rec["pid"]), 0)
    except (TypeError, ValueError, KeyError, ProcessLookupError):  # no usable pid, or no such process
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """A held run-directory lock; :meth:`release` (or the process ending) frees it."""

    def __init__(self, run_dir: Path, fd: int, record: dict[str, Any], took_over: dict[str, Any] | None) -> None:
        self.run_dir, self.path = run_dir, run_dir / LOCK_FILE
        self._fd: int | None = fd
        self.record = record
        #: the stale record this lock replaced (a run that was killed), or ``None``
        self.took_over = took_over
        #: whether :func:`claim_run_dir` created the run directory (then a failed start removes it)
        self.created = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file, then drop the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            # Unlink while still locked: a process waiting on this inode sees it unlinked and retries on a new file.
            if _same_file(self.path, self._fd):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def abandon(self) -> None:
        """A start that failed: release, and remove the run directory if this run created it (nothing else can have
        written into it while the lock was held), so a failed start leaves no debris."""
        self.release()
        if self.created:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def finish(self) -> None:
        """A run that ended: release, and remove the run directory only if this run created it and left it empty."""
        self.release()
        if self.created:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:  # a driver that is garbage-collected without close() must not keep the directory
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _this_command() -> str:
    """How this process was started, as a user would type it (``python -m pkg`` rather than ``.../__main__.py``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name:
        head = f"python -m {name[: -len('.__main__')] if name.endswith('.__main__') else name}"
    else:
        head = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return " ".join([head] + sys.argv[1:])


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def acquire_run_lock(
    run_dir: str | os.PathLike,
    *,
    command: str | None = None,
    what: str = "--run-dir",
    warn: Callable[[str], None] | None = None,
) -> RunLock:
    """Lock ``run_dir`` (which must exist) for this process, or raise :class:`RunDirInUse` naming the holder.

    ``what`` names the setting the user chose the directory with (``--run-dir``, ``trainer.default_local_dir``) so
    the message says what to change. A stale lock (its process is gone) is reported through ``warn`` (default: this
    module's logger) and taken over."""
    warn = warn or log.warning
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": (command if command is not None else _this_command())[:300],
    }
    for _ in range(20):  # retries only when the file is replaced between open and lock (a holder releasing)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = _try_flock(fd)
            holder = _parse(_read_fd(fd)) if flocked is False else None
            while flocked is False and not holder:
                # The holder writes its record just after taking the lock: a start racing it reads an empty file.
                # Wait for the record, or for the lock to come free (a holder that died in between).
                time.sleep(0.01)
                flocked = _try_flock(fd)
                holder = _parse(_read_fd(fd)) if flocked is False else None
            if flocked is False:
                raise RunDirInUse(
                    f"{what} {run_dir} is in use by {_describe(holder)}: wait for that run to end, or "
                    f"choose another {what}"
                )
            if not _same_file(path, fd):
                os.close(fd)  # the holder released (unlinked) it between our open and lock: try the new file
                continue
            old = _parse(_read_fd(fd))
            if old and old.get("pid") == os.getpid() and old.get("host") == record["host"]:
                raise RunDirInUse(f"{what} {run_dir} is already in use by this process")
            if flocked is None and old and _alive_here(old):  # no flock here: the record decides
                raise RunDirInUse(
                    f"{what} {run_dir} is in use by {_describe(old)}: wait for that run to end, or "
                    f"choose another {what}"
                )
            if old:
                warn(
                    f"{path}: taking over the lock of {_describe(old)}, which is no longer running (a run that was "
                    "killed)"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
            lock = RunLock(run_dir, fd, record, old or None)
            atexit.register(lock.release)  # an ordinary exit (also SystemExit, Ctrl-C) leaves no lock file behind
            return lock
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    raise RunDirInUse(f"{what} {run_dir}: could not take {path} (it keeps being replaced)")  # pragma: no cover


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another open file holds it; None: this filesystem has no flock."""
    if fcntl is None:  # pragma: no cover
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP, ...: fall back to the record
    return True


def _read_fd(fd: int) -> str:
    chunks, off = [], 0
    while True:
        b = os.pread(fd, 4096, off)
        if not b:
            break
        chunks.append(b)
        off += len(b)
    return b"".join(chunks).decode("utf-8", "replace")


def claim_run_dir(
    run_dir: str | os.PathLike,
    *,
    what: str = "--run-dir",
    command: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> RunLock:
    """Create ``run_dir`` if needed and lock it (:func:`acquire_run_lock`); ``lock.created`` records whether this
    call created the folder. ``os.mkdir``, not ``exist_ok``: of two runs started together only the one that made
    the folder may remove it after a failed start."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(run_dir)
        created = True
    except FileExistsError:
        created = False
    try:
        lock = acquire_run_lock(run_dir, what=what, command=command, warn=warn)
    except BaseException:
        if created:  # the other run may have taken the lock on the folder we made: remove it only if still empty
            try:
                run_dir.rmdir()
            except OSError:
                pass
        raise
    lock.created = created
    return lock
