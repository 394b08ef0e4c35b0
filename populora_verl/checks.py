"""Checks of what a run refers to outside its own config: operator names, the seed file, vLLM, the device.

The verl start-up check (:mod:`populora_verl.startup`), the CPU driver and ``populora-eval`` run them before Ray
starts or any model loads: each of these used to surface only once the run was under way (an unknown operator at
the first evolution event, a missing seed file as a bare errno after the model loaded, a missing vLLM after Ray
and the workers started). Each raises :class:`~populora_verl.config.ConfigError` with one line naming the key.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from populora_verl.config import ROOT, ConfigError

__all__ = [
    "VLLM_INSTALL",
    "check_operators",
    "check_seed_file",
    "check_population_inputs",
    "check_device",
    "vllm_missing",
]

#: How to get vLLM: verl's own extra pins the vLLM, torch and transformers that verl 0.9.1 was released with.
VLLM_INSTALL = "pip install 'verl[vllm]==0.9.1' on a CUDA machine (README.md, Training with verl on GPUs)"


def check_operators(cfg: Any) -> None:
    """``populora.pbt.operators`` and ``operator_params`` against the operator registry (``cfg``: the
    :class:`~populora_verl.config.PopuLoRAConfig`), so a typo stops the start, not the first evolution event."""
    if not cfg.pbt.enabled:
        return
    from populora_verl.evolution.pbt import PBTController

    PBTController(cfg.pbt)  # resolves every name and parameter; raises ConfigError naming the key


def check_seed_file(cfg: Any) -> None:
    """``populora.buffer.seed_file``: it must exist (unless ``seed_file_wait_s`` waits for another run to write
    it) and every line must parse."""
    path = cfg.buffer.seed_file
    key = f"{ROOT}.buffer.seed_file"
    if not path:
        return
    if not os.path.exists(path):
        if cfg.buffer.seed_file_wait_s > 0:
            return  # another run writes it; the first step waits for it
        raise ConfigError(
            f"{key}: no such file {path!r} (set {ROOT}.buffer.seed_file_wait_s to wait for a seed "
            "set another run is writing)"
        )
    if os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is a folder, not a JSONL file")
    from populora_verl.tasks.buffer import load_seed_file

    try:
        load_seed_file(path)
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path!r} is not a UTF-8 JSONL file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {' '.join(str(e).split())}") from None


def check_population_inputs(cfg: Any) -> None:
    """Everything above that the population's config names: the checks every entry point runs."""
    check_operators(cfg)
    check_seed_file(cfg)


def check_device(device: Any, key: str = "trainer.device") -> None:
    """verl's ``trainer.device=cpu`` starts Ray and then waits for GPU workers that never come."""
    if str(device).lower() == "cpu":
        raise ConfigError(
            f"{key}: PopuLoRA's verl runs need GPUs (vLLM serves the adapters); on a CPU machine "
            "use `python -m populora_verl.local`"
        )


def vllm_missing() -> str | None:
    """Why vLLM cannot be imported here, with how to get it; None when it is installed."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {VLLM_INSTALL}"
    return None
