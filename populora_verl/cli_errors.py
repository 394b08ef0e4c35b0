"""One error style for every console script (``populora-local``, ``populora-eval``, ``populora-report``,
``populora-export``, ``python -m populora_verl.models``, the validity probe), and the path checks they run before
any model loads.

A user who mistypes a path should read one line that says what is wrong, not a 40-line traceback, and should read
it before minutes of model loading, generation or grading, not after: ``prog: error: <what is wrong>``. Bad input
found before any work (a flag, a path, a config key, a run directory in use) exits with status 2; a failure while
working exits with 1 and mentions ``--debug``, which brings the traceback back for a bug report.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["UsageError", "one_line", "run_cli", "check_output_dir", "check_run_dir", "check_model_path", "looks_local"]

# Exceptions whose message already says everything; others are prefixed with their type.
_PLAIN = (
    "ConfigError",
    "CheckpointError",
    "FileNotFoundError",
    "FileExistsError",
    "NotADirectoryError",
    "UsageError",
    "RunDirInUse",
)
# Bad input found before any work started: exit status 2, and no "--debug" hint (there is no bug to report).
_USAGE = ("UsageError", "ConfigError", "RunDirInUse")


class UsageError(Exception):
    """Bad input found before any work started (a flag, a path): one line, exit status 2."""


def one_line(e: BaseException) -> str:
    """``e`` as one line: its message with whitespace collapsed (prefixed by its type unless self-explanatory)."""
    text = " ".join(str(e).split())
    if len(text) > 400:
        text = text[:400] + " ..."
    if type(e).__name__ in _PLAIN and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def run_cli(
    prog: str, fn: Callable[[], int], *, debug: bool = False, on_interrupt: Callable[[], str] | None = None
) -> int:
    """Run ``fn``; an exception ends it with one ``prog: error: ...`` line on stderr (exit 2 for bad input, 1 for
    a failure while working), Ctrl-C with one line (``on_interrupt()``'s text, exit 130). ``debug`` re-raises."""
    try:
        return fn()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{prog}: {on_interrupt() if on_interrupt else 'interrupted'}", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e.code, str) and not debug:  # raise SystemExit("message"): the same one-line form
            print(f"{prog}: error: {' '.join(e.code.split())}", file=sys.stderr)
            return 1
        raise
    except Exception as e:  # noqa: BLE001 - the point is to catch everything the user may trigger
        if debug:
            raise
        if type(e).__name__ in _USAGE:
            print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
            return 2
        print(f"{prog}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1


# --- path checks, before any model loads ----------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _writable_dir(d: Path) -> bool:
    """Whether a file can be created in ``d``. Tried for real: ``os.access`` says yes to root on a read-only mount."""
    try:
        fd, name = tempfile.mkstemp(prefix=".populora-write-check-", dir=d)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _check_link(p: Path, path: str | os.PathLike, flag: str) -> None:
    # A link to nothing "does not exist", yet cannot be created either: mkdir would fail with a bare errno.
    if p.is_symlink() and not p.exists():
        raise UsageError(f"{flag} {path}: a link to {os.readlink(p)}, which does not exist")


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """A folder this run will create or write into: an existing folder must be writable; a new one must be
    creatable (its nearest existing parent a writable folder). Creates nothing; raises :class:`UsageError`."""
    p = Path(path).expanduser()
    _check_link(p, path, flag)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {path}: is a file, not a folder")
        if not _writable_dir(p):
            raise UsageError(f"{flag} {path}: the folder is not writable")
        return p
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise UsageError(f"{flag} {path}: {base} is a file, so the folder cannot be created")
    if not _writable_dir(base):
        raise UsageError(f"{flag} {path}: cannot create it ({base} is not writable)")
    return p


def check_run_dir(path: str | os.PathLike, flag: str = "--run-dir", *, must_exist: bool = False) -> Path:
    """A run directory: ``must_exist`` for one that is read or resumed, else like :func:`check_output_dir`."""
    p = Path(path).expanduser()
    if must_exist:
        _check_link(p, path, flag)
        if not p.exists():
            raise UsageError(f"{flag} {path}: no such directory")
        if not p.is_dir():
            raise UsageError(f"{flag} {path}: is a file, not a folder")
        return p
    return check_output_dir(p, flag)


def looks_local(path: str) -> bool:
    """An absolute, ``./``- or ``~``-relative path, or something that exists here, is a folder on this machine;
    anything else (``org/name``) may be a model hub id."""
    return os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(os.path.expanduser(path))


def check_model_path(path: str, flag: str = "--model", *, hub: bool = True) -> str:
    """A base model: a local folder with ``config.json``, or (``hub``, unless ``HF_HUB_OFFLINE`` is set) a hub id.
    Raises :class:`UsageError` naming ``flag`` instead of the hub client's "Repo id must be ..." after imports."""
    local = os.path.expanduser(str(path))
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if looks_local(str(path)) or offline or not hub:
        if not os.path.isdir(local):
            why = "" if looks_local(str(path)) or not offline else " (HF_HUB_OFFLINE is set, so it cannot be a hub id)"
            raise UsageError(f"{flag} {path}: no such directory{why}")
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise UsageError(
                f"{flag} {path}: holds no HF model (no config.json); convert a GGUF with "
                "`python -m populora_verl.models convert`"
            )
    return str(path)
