"""Population state on disk: a directory a user can inspect.

```
<dir>/population.json          members + lineage, ratings (+ TrueSkill env), step, component states (RNGs)
<dir>/adapters/<id>/adapter_model.safetensors   the member's PEFT LoRA state dict, keys as PEFT saves them
<dir>/adapters/<id>/adapter_config.json         the shared LoraConfig (PeftModel.from_pretrained loads it)
```

Saves are atomic: everything is written into a hidden sibling temp directory, flushed, and renamed into place
last, so a crash mid-save leaves the previous save (or nothing) at ``<dir>``, never a half-written one.
Floats go through JSON's shortest round-trip repr and tensors through safetensors, so a load is bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from populora_verl.fsutil import swap_dir, write_json

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from populora_verl.population.members import Population

__all__ = ["FORMAT", "adapter_config_dict", "save_population", "read_population_state", "write_adapter", "read_adapter"]

FORMAT = "populora.population/1"
POPULATION_FILE = "population.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _write_json(path: Path, obj: Any) -> None:
    write_json(path, obj, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def adapter_config_dict(lora_config: Any) -> dict[str, Any]:
    """The adapter_config.json payload (a ``peft.LoraConfig`` or a dict of its fields), completed and serialised
    by peft itself so that ``PeftModel.from_pretrained`` reads it back."""
    from peft import LoraConfig  # heavy: only when adapters are written

    if not isinstance(lora_config, LoraConfig):
        cfg = dict(lora_config)
        cfg.pop("peft_type", None)
        cfg.pop("peft_version", None)
        lora_config = LoraConfig(**cfg)
    d = lora_config.to_dict()
    d["peft_type"] = str(getattr(d["peft_type"], "value", d["peft_type"]))
    if d.get("task_type") is not None:
        d["task_type"] = str(getattr(d["task_type"], "value", d["task_type"]))
    return _jsonable(d)


def write_adapter(folder: str | Path, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """Write one PEFT adapter folder (weights in safetensors, keys exactly as given)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    # JSON cannot hold sets (peft keeps target_modules as a set after __post_init__).
    _write_json(folder / ADAPTER_CONFIG, _jsonable(dict(config)))


def read_adapter(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    folder = Path(folder)
    with open(folder / ADAPTER_CONFIG, encoding="utf-8") as f:
        config = json.load(f)
    return dict(load_file(str(folder / ADAPTER_WEIGHTS))), config


def _component_state(obj: Any) -> Any:
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def save_population(
    population: Population,
    directory: str | Path,
    adapters: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    lora_config: Mapping[str, Any] | None = None,
    states: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``population`` (and the alive members' adapters) to ``directory``, replacing it atomically.

    ``states`` maps a name to a component (anything with ``state_dict()``, e.g. the Matchmaker or the
    PBTController) or to its already-built JSON-able state; it is restored as ``population.states[name]``.
    Only the states given here are saved (never ones left over from an earlier load).
    """
    directory = Path(directory)
    if adapters is not None:
        missing = [i for i in population.ids() if i not in adapters]
        if missing:
            raise ValueError(f"adapters missing for alive members {missing}")
        lora_config = lora_config if lora_config is not None else population.lora_config
        if lora_config is None:
            raise ValueError("saving adapters needs lora_config (r, lora_alpha, target_modules, ...)")
    state = population.state_dict()
    # Only the states handed in now: re-saving states loaded earlier would silently rewind an RNG.
    state["states"] = {k: _component_state(v) for k, v in (states or {}).items()}
    if lora_config is not None:
        lora_config = adapter_config_dict(lora_config)
        state["lora_config"] = lora_config
    state = {"format": FORMAT, **state, "adapters": population.ids() if adapters is not None else None}

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        if adapters is not None:
            for mid in population.ids():
                write_adapter(tmp / "adapters" / mid, adapters[mid], lora_config)
        # population.json last: inside the temp dir it marks the save as complete.
        _write_json(tmp / POPULATION_FILE, state)
        swap_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lora_config is not None:
        population.lora_config = dict(lora_config)
    return directory


def read_population_state(directory: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]] | None]:
    """The state dict :func:`save_population` wrote and the adapters saved with it (None when none were):
    :meth:`Population.load <populora_verl.population.members.Population.load>` builds the population from them."""
    directory = Path(directory)
    path = directory / POPULATION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a complete population save")
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported format {state.get('format')!r} (expected {FORMAT!r})")
    ids = state.get("adapters")
    if ids is None:
        return state, None
    return state, {mid: read_adapter(directory / "adapters" / mid)[0] for mid in ids}
