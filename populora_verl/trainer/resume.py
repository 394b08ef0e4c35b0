"""Which ``global_step_N`` a verl run resumes from, when the newest one is damaged.

verl's ``resume_mode=auto`` takes the folder named by ``latest_checkpointed_iteration.txt`` and fails deep inside a
worker if a file in it is truncated. Before verl loads anything, :func:`choose_resume_folder` checks the PopuLoRA
part of each candidate (population, adapters, step state, buffers, coverage, adapter-bank files) and verl's actor
folder, newest first. A damaged one is reported in one line naming the file and the next older one is used; when
none is usable the run stops with one message instead of silently starting fresh.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable

from populora_verl.checkpoint import Checkpoint, CheckpointError, latest_checkpoint, load_checkpoint, newest_loadable

__all__ = ["choose_resume_folder", "check_bank_files", "tracked_folder", "prune_step_folders"]

TRACKER = "latest_checkpointed_iteration.txt"  # verl's name (verl.utils.checkpoint.checkpoint_manager)
_GLOBAL_STEP = re.compile(r"^global_step_(\d+)$")


def tracked_folder(default_local_dir: str | os.PathLike) -> Path | None:
    """The ``global_step_N`` folder verl's tracker file names (``None`` without a readable tracker)."""
    tracker = Path(default_local_dir) / TRACKER
    try:
        return Path(default_local_dir) / f"global_step_{int(tracker.read_text().strip())}"
    except (OSError, ValueError):
        return None


def check_bank_files(bank_dir: Path) -> None:
    """Every per-rank adapter-bank file is present and a readable ``torch.save`` archive (a zip: a truncated file
    loses its central directory, which :class:`zipfile.ZipFile` reads first, so this costs no tensor reads)."""
    files = sorted(bank_dir.glob("bank_world_size_*_rank_*.pt")) if bank_dir.is_dir() else []
    if not files:
        raise CheckpointError(f"{bank_dir}: no adapter-bank files (bank_world_size_W_rank_R.pt)")
    sizes = {int(m.group(1)) for f in files if (m := re.search(r"world_size_(\d+)_", f.name))}
    for w in sizes:
        for r in range(w):
            if not (bank_dir / f"bank_world_size_{w}_rank_{r}.pt").is_file():
                raise CheckpointError(f"{bank_dir / f'bank_world_size_{w}_rank_{r}.pt'}: missing")
    for f in files:
        try:
            with zipfile.ZipFile(f) as z:
                z.infolist()
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from e


def _check_folder(folder: Path) -> Checkpoint:
    actor = folder / "actor"
    if not actor.is_dir() or not any(actor.iterdir()):
        raise CheckpointError(f"{actor}: missing or empty (verl's actor checkpoint)")
    pdir = folder / "populora"
    if not pdir.is_dir():
        raise CheckpointError(f"{pdir}: missing (the population and adapter bank of this step)")
    inner = latest_checkpoint(pdir)
    if inner is None:
        raise CheckpointError(f"{pdir / 'checkpoints'}: no complete population checkpoint (COMPLETE marker missing)")
    ck = load_checkpoint(inner)
    check_bank_files(pdir / "bank")
    return ck


def choose_resume_folder(
    default_local_dir: str | os.PathLike, warn: Callable[[str], None] = print
) -> tuple[Path | None, Checkpoint | None]:
    """``(global_step folder, its loaded PopuLoRA checkpoint)`` to resume from, or ``(None, None)`` for a fresh
    run (no tracker file). Candidates are the tracker's step and older ones, newest first. Raises
    :class:`CheckpointError` when there are checkpoints but none is usable."""
    root = Path(default_local_dir)
    tracker = root / TRACKER
    if not tracker.is_file():
        return None, None
    try:
        newest = int(tracker.read_text().strip())
    except ValueError as e:
        raise CheckpointError(f"{tracker}: unreadable ({e})") from e
    steps = sorted(
        (int(m.group(1)) for p in root.iterdir() if (m := _GLOBAL_STEP.match(p.name)) and p.is_dir()), reverse=True
    )
    folder, ck, tried = newest_loadable(
        [root / f"global_step_{s}" for s in steps if s <= newest], _check_folder, warn, prefix="[populora] "
    )
    if folder is not None:
        return folder, ck
    raise CheckpointError(
        f"no usable checkpoint in {root} (tried {', '.join(tried) or 'none: no global_step_N folder'}"
        f"); fix or move the damaged folders, or set trainer.resume_mode=disable to start fresh"
    )


def prune_step_folders(default_local_dir: str | os.PathLike, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` ``global_step_N`` folders (``trainer.max_actor_ckpt_to_keep``; None or
    < 1 keeps everything) and return what went. verl's own pruning removes only the ``actor`` sub-folder, which
    would leave our ``populora`` part behind as a checkpoint that can no longer be resumed. The folder verl's
    tracker names is never deleted, whatever its age."""
    if keep is None or int(keep) < 1:
        return []
    root = Path(default_local_dir)
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _GLOBAL_STEP.match(p.name)) and p.is_dir())
    protected = tracked_folder(root)
    gone = []
    for _, folder in steps[: max(0, len(steps) - int(keep))]:
        if protected is not None and folder.resolve() == protected.resolve():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(folder)
    return gone
