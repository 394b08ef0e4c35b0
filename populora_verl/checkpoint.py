"""Atomic, inspectable checkpoints of a PopuLoRA run (layout: docs/CONTRACTS.md, "Run directory").

::

    <run_dir>/checkpoints/step_<N>/  population/     Population.save: population.json + adapters/<id>/ (PEFT folders)
                                     optimizer/<id>.pt   each member's optimizer state (torch.save)
                                     state.json      step, the orchestration's state (matchmaking, PBT, RNG) and the
                                                     process RNGs (python, numpy, torch)
                                     buffers.json    task buffers
                                     coverage.npz    CVT coverage archive (arrays)
                                     COMPLETE        written last inside the temporary folder
    <run_dir>/checkpoints/latest     text "step_<N>", replaced atomically after the folder is in place

Atomicity: everything is written into ``step_<N>.tmp`` which is renamed to ``step_<N>`` only when complete, and
``latest`` is updated last through a temporary file and ``os.replace``. A crash at any point leaves either the
previous checkpoint or the new one; a ``*.tmp`` folder (or any folder without ``COMPLETE``) is never loaded.

Damage after the fact (a truncated or deleted file, a disk that filled up under another tool) is caught on load:
:func:`load_checkpoint` raises :class:`CheckpointError` naming the file, and :func:`load_latest_checkpoint` reports
it in one line and falls back to the newest older checkpoint that loads.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from populora_verl.fsutil import swap_dir, write_json, write_text_atomic

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "load_latest_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used. The message is one line and names the file at fault."""


# --- RNG state -----------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU) RNG states as JSON-able data."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))


# --- arrays inside a state dict ------------------------------------------------------------------------------


def _split_arrays(obj: Any, arrays: dict[str, np.ndarray], path: str = "") -> Any:
    """Replace numpy arrays / tensors in a nested structure by ``{"__array__": key}`` and collect them."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        key = path.strip("/").replace("/", ".") or "root"
        arrays[key] = obj
        return {"__array__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return {str(k): _split_arrays(v, arrays, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split_arrays(v, arrays, f"{path}/{i}") for i, v in enumerate(obj)]
    return obj


def _join_arrays(obj: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            return np.array(arrays[obj["__array__"]])
        return {k: _join_arrays(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_arrays(v, arrays) for v in obj]
    return obj


# --- checkpoints ---------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A loaded checkpoint. ``step`` is the number of completed steps."""

    path: Path
    step: int
    population: Any  # populora_verl.population.Population
    adapters: dict[str, dict[str, torch.Tensor]]
    optimizers: dict[str, dict[str, Any]]
    step_state: dict[str, Any]  # PopulationStep.state_dict()
    rng: dict[str, Any] | None
    extra: dict[str, Any]


def _write_json(path: Path, data: Any) -> None:
    write_json(path, data, sort_keys=True)


def _owner_only(folder: Path) -> None:
    """Folders 0700 and files 0600 under ``folder``, so that a copy moved out of the private parent stays private."""
    os.chmod(folder, 0o700)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o700)
        for name in filenames:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o600)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    population: Any,
    adapters: Mapping[str, Mapping[str, torch.Tensor]],
    lora_config: Mapping[str, Any] | None,
    optimizers: Mapping[str, Mapping[str, Any]],
    step_state: Mapping[str, Any],
    rng: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step>`` atomically, then point ``latest`` at it. Returns the folder.

    ``step_state`` is :meth:`PopulationStep.state_dict`; its ``buffers`` go to ``buffers.json`` and every array in
    it (the coverage archive) to ``coverage.npz``. ``rng`` defaults to the process RNGs captured now.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    # The buffers hold code_f's hidden golds: a program running as another uid must not read them, whatever
    # the umask (the sandbox also hides the trainer's working directory and home where it can).
    for folder in (Path(run_dir), root):
        os.chmod(folder, 0o700)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # leftovers of a save that crashed
    tmp.mkdir(mode=0o700)

    population.save(tmp / "population", adapters=dict(adapters), lora_config=dict(lora_config) if lora_config else None)
    (tmp / "optimizer").mkdir()
    for member_id, state in optimizers.items():
        torch.save(state, tmp / "optimizer" / f"{member_id}.pt")

    state = dict(step_state)
    buffers = state.pop("buffers", None)
    _write_json(tmp / "buffers.json", buffers)
    arrays: dict[str, np.ndarray] = {}
    state = _split_arrays(state, arrays)
    np.savez(tmp / "coverage.npz", **arrays)
    _write_json(
        tmp / "state.json",
        {
            "step": int(step),
            "populora": state,
            "rng": dict(rng) if rng is not None else capture_rng_state(),
            "extra": dict(extra or {}),
            # which optimizer files belong to this checkpoint, so a deleted one is noticed instead of silently reset
            "optimizers": sorted(optimizers),
        },
    )
    (tmp / COMPLETE).write_text(f"step_{step}\n")
    _owner_only(tmp)

    swap_dir(tmp, final)  # re-saving a step (e.g. after a resume) replaces it whole
    write_text_atomic(root / LATEST, f"step_{step}\n")
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never the one ``latest`` names); returns what went.

    Each victim is first renamed to a hidden ``.step_N.deleted-<id>`` folder and only then removed, so a crash in
    the middle of a deletion never leaves a half-deleted folder that still looks like a checkpoint. Incomplete
    folders (``*.tmp``, no ``COMPLETE``) are left alone: the next save of that step replaces them."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    complete = list_checkpoints(run_dir)
    latest = latest_checkpoint(run_dir)
    gone = []
    for path in complete[:-keep]:
        if latest is not None and path == latest:
            continue
        aside = path.parent / f".{path.name}.deleted-{uuid.uuid4().hex[:8]}"
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
        gone.append(path)
    return gone


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The folder ``latest`` names if it is complete, else the newest complete one, else ``None``."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        cand = root / name
        if _STEP_DIR.match(name) and (cand / COMPLETE).is_file():
            return cand
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _read(path: Path, reader: Callable[[Path], Any]) -> Any:
    """``reader(path)``, with any failure turned into a :class:`CheckpointError` that names ``path``."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return reader(path)
    except Exception as e:  # truncated zip/pickle/safetensors/JSON all raise different types
        raise CheckpointError(f"{path}: unreadable ({_one_line(e)})") from e


def _read_json(path: Path) -> Any:
    return _read(path, lambda p: json.loads(p.read_text(encoding="utf-8")))


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    def read(p: Path) -> dict[str, np.ndarray]:
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}  # reads every array: a truncated member fails here, not later

    return _read(path, read)


def _population_culprit(pop_dir: Path) -> None:
    """Find the file that made ``Population.load`` fail and raise a :class:`CheckpointError` naming it."""
    from safetensors.torch import load_file

    from populora_verl.population.state import ADAPTER_CONFIG, ADAPTER_WEIGHTS, POPULATION_FILE

    state = _read_json(pop_dir / POPULATION_FILE)
    for mid in (state.get("adapters") or []) if isinstance(state, dict) else []:
        _read_json(pop_dir / "adapters" / mid / ADAPTER_CONFIG)
        _read(pop_dir / "adapters" / mid / ADAPTER_WEIGHTS, lambda p: load_file(str(p)))


def load_checkpoint(path: str | os.PathLike, *, population_cls: Any = None) -> Checkpoint:
    """Load a checkpoint folder (or a run directory: its newest checkpoint that loads, see
    :func:`load_latest_checkpoint`). Raises :class:`CheckpointError` naming the first damaged or missing file."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        return load_latest_checkpoint(path, population_cls=population_cls)
    if population_cls is None:
        from populora_verl.population import Population as population_cls
    pop_dir = path / "population"
    try:
        population, adapters = population_cls.load(pop_dir)
    except Exception as e:
        _population_culprit(pop_dir)  # raises naming the file when it can find it
        raise CheckpointError(f"{pop_dir}: unreadable ({_one_line(e)})") from e
    meta = _read_json(path / "state.json")
    if not isinstance(meta, dict) or "step" not in meta or "populora" not in meta:
        raise CheckpointError(f"{path / 'state.json'}: not a checkpoint state (no step / populora entries)")
    optimizers = {}
    opt_dir = path / "optimizer"
    names = meta.get("optimizers")  # absent in checkpoints written before it was recorded
    files = [opt_dir / f"{n}.pt" for n in names] if names is not None else sorted(opt_dir.glob("*.pt"))
    for f in files:
        optimizers[f.stem] = _read(f, lambda p: torch.load(p, map_location="cpu", weights_only=False))
    arrays = _read_npz(path / "coverage.npz")
    try:
        step_state = _join_arrays(meta["populora"], arrays)
    except KeyError as e:
        raise CheckpointError(f"{path / 'coverage.npz'}: array {e} is missing") from e
    step_state["buffers"] = _read_json(path / "buffers.json")
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        population=population,
        adapters=dict(adapters or {}),
        optimizers=optimizers,
        step_state=step_state,
        rng=meta.get("rng"),
        extra=meta.get("extra", {}),
    )


def newest_loadable(
    candidates: Iterable[Path], load: Callable[[Path], Any], warn: Callable[[str], None], prefix: str = ""
) -> tuple[Path | None, Any, list[str]]:
    """Try ``candidates`` (newest first) until ``load`` succeeds: ``(candidate, loaded, names skipped)``, or
    ``(None, None, names skipped)``. Each :class:`CheckpointError` is reported in one line through ``warn``; the CPU
    driver and the verl trainer fall back the same way."""
    skipped: list[str] = []
    for cand in candidates:
        try:
            loaded = load(cand)
        except CheckpointError as e:
            warn(f"{prefix}checkpoint {cand.name} cannot be loaded: {e}; trying the previous one")
            skipped.append(cand.name)
            continue
        if skipped:
            warn(f"{prefix}resuming from {cand.name}, the newest checkpoint that loads")
        return cand, loaded, skipped
    return None, None, skipped


def load_latest_checkpoint(
    run_dir: str | os.PathLike, *, population_cls: Any = None, warn: Callable[[str], None] | None = None
) -> Checkpoint:
    """The newest checkpoint of ``run_dir`` that loads. Each one skipped (no ``COMPLETE`` marker, or a damaged or
    missing file) is reported in one line through ``warn`` (default: this module's logger). Raises
    :class:`CheckpointError` when none loads."""
    warn = warn or log.warning
    root = Path(run_dir) / CHECKPOINTS
    complete = list_checkpoints(run_dir)
    newest = int(_STEP_DIR.match(complete[-1].name).group(1)) if complete else -1
    if root.is_dir():
        for p in sorted(root.iterdir()):
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and int(m.group(1)) > newest and not (p / COMPLETE).is_file():
                warn(f"checkpoint {p}: no {COMPLETE} marker (an interrupted or damaged save), skipped")
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {root}")
    first = latest_checkpoint(run_dir)  # what ``latest`` names, when complete
    found, ck, problems = newest_loadable(
        [first] + [c for c in reversed(complete) if c != first],
        lambda c: load_checkpoint(c, population_cls=population_cls),
        warn,
    )
    if found is None:
        raise CheckpointError(
            f"no checkpoint in {root} can be loaded (tried {', '.join(problems)}); "
            "see the lines above for the damaged files"
        )
    return ck
