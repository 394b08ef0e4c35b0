"""Progress files of the background GPU drivers (step_scaling, learning_run): a ``progress.json`` the driver updates
atomically and the status calls read, and whether the driver's pid is still alive."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["read_progress", "write_progress", "alive"]


def read_progress(root: Path) -> dict[str, Any] | None:
    """``<root>/progress.json``, or ``None`` where no driver has written one."""
    path = Path(root) / "progress.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_progress(root: Path, **state: Any) -> None:
    """Merge ``state`` into ``<root>/progress.json`` (written whole, then renamed: a reader never sees half)."""
    path = Path(root) / "progress.json"
    cur = read_progress(root) or {}
    cur.update(state, updated=time.time())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cur, indent=1, default=str))
    os.replace(tmp, path)


def alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, TypeError, ValueError):
        return False
