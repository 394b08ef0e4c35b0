"""Ending a run early at a safe step: ``touch <trainer.default_local_dir>/STOP``.

A run that must end before ``trainer.total_training_steps`` (a GPU reservation running out, a budget spent) should still
end with a checkpoint whose members are all past the final quiet window (``populora.pbt.final_quiet_steps``): a
member evaluated right after its operator has not recovered from it. The trainer reads the stop file after every
step; once it exists, the run ends at the first step where no living member is younger than the window (any step
when PBT is off), skipping that step's evolution, saving a checkpoint and returning from ``fit``. The file may hold a
step number: then the run goes on at least to that step (``echo 40 > STOP``). The path is
``trainer.populora_stop_file`` when set.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

__all__ = ["STOP_FILE_KEY", "stop_file", "read_request", "due"]

STOP_FILE_KEY = "trainer.populora_stop_file"


def stop_file(config: Any) -> str:
    """The stop file's path: ``trainer.populora_stop_file``, else ``<trainer.default_local_dir>/STOP``."""
    path = OmegaConf.select(config, STOP_FILE_KEY, default=None)
    if not path:
        path = os.path.join(str(OmegaConf.select(config, "trainer.default_local_dir", default=".")), "STOP")
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def read_request(path: str) -> int | None:
    """``None``: no stop file. Else the first step the run may end at (0: the next safe one). Text that is not a
    step number counts as 0: whoever wrote the file wants the run to end."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(64).strip()
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    try:
        return max(0, int(text)) if text else 0
    except ValueError:
        return 0


def due(request: int | None, step: int, youngest_age: int | None, window: int | None) -> bool:
    """End the run after ``step``? Only once requested, at or after the requested step, and when every living
    member has trained at least ``window`` steps since its birth (``youngest_age`` / ``window`` None: no PBT)."""
    if request is None or step < request:
        return False
    return window is None or youngest_age is None or youngest_age >= window
