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
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from populora_verl.fsutil import swap_dir, write_json, write_text_atomic

__all__ = [
    "Checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, population: Any,
                    adapters: Mapping[str, Mapping[str, torch.Tensor]], lora_config: Mapping[str, Any] | None,
                    optimizers: Mapping[str, Mapping[str, Any]], step_state: Mapping[str, Any],
                    rng: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step>`` atomically, then point ``latest`` at it. Returns the folder.

    ``step_state`` is :meth:`PopulationStep.state_dict`; its ``buffers`` go to ``buffers.json`` and every array in
    it (the coverage archive) to ``coverage.npz``. ``rng`` defaults to the process RNGs captured now.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # leftovers of a save that crashed
    tmp.mkdir()

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
    _write_json(tmp / "state.json", {
        "step": int(step),
        "populora": state,
        "rng": dict(rng) if rng is not None else capture_rng_state(),
        "extra": dict(extra or {}),
    })
    (tmp / COMPLETE).write_text(f"step_{step}\n")

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


def load_checkpoint(path: str | os.PathLike, *, population_cls: Any = None) -> Checkpoint:
    """Load a checkpoint folder (or a run directory: its latest complete checkpoint)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint in {path}")
        path = found
    if population_cls is None:
        from populora_verl.population import Population as population_cls
    population, adapters = population_cls.load(path / "population")
    optimizers = {}
    opt_dir = path / "optimizer"
    for f in sorted(opt_dir.glob("*.pt")):
        optimizers[f.stem] = torch.load(f, map_location="cpu", weights_only=False)
    meta = json.loads((path / "state.json").read_text())
    with np.load(path / "coverage.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    step_state = _join_arrays(meta["populora"], arrays)
    step_state["buffers"] = json.loads((path / "buffers.json").read_text())
    return Checkpoint(path=path, step=int(meta["step"]), population=population, adapters=dict(adapters or {}),
                      optimizers=optimizers, step_state=step_state, rng=meta.get("rng"), extra=meta.get("extra", {}))
