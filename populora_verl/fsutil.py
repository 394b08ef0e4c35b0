"""Crash-safe file writes shared by the savers (population state, CPU-driver checkpoints).

A save is written completely somewhere private, flushed to disk, then moved into place with a rename, so a
process killed at any moment leaves either the previous complete save or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_json", "write_text_atomic", "swap_dir", "staged_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (renames inside it) to disk; a no-op where the filesystem cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any, **dump_kwargs: Any) -> None:
    """``json.dump`` to ``path`` (indent 1) and fsync it. Not atomic on its own: write into a private folder."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, **dump_kwargs)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path``'s content with ``text`` in one rename (readers see the old or the new file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def swap_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the complete directory ``tmp`` to ``final``. An existing ``final`` is first renamed aside to a hidden
    ``.<name>.old-<id>`` (never mistaken for a save) and deleted once the new one is in place."""
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A private folder next to ``final`` to write into; it becomes ``final`` (:func:`swap_dir`) when the block
    ends without an error, and is removed otherwise. Next to it, not in /tmp: the move is a rename on the same
    filesystem, never a second copy of a folder of many GB."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        swap_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
