"""Start-up checks that run before Ray and TransferQueue start.

``python -m verl.trainer.main_ppo`` starts Ray, TransferQueue and the workers before our trainer class is built,
so a missing model or a machine without GPUs used to show up minutes later, or as a silent hang. The recipes
declare :class:`PreflightCallback` as a Hydra callback (``hydra.callbacks.populora_preflight`` in
``recipes/populora/populora_base.yaml``); Hydra calls its ``on_job_start`` with the composed config before
verl's ``main``, and a failed check ends the command with one line naming the key (exit status 2).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback

from populora_verl.config import ConfigError

__all__ = ["preflight", "PreflightCallback"]

MODEL_KEY = "actor_rollout_ref.model.path"


def _select(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=default, throw_on_missing=False)


def _check_model_path(config: Any) -> None:
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(config, "actor_rollout_ref") or _select(config, MODEL_KEY) is None:
        raise ConfigError(f"{MODEL_KEY}: is required (a local HF model folder or a hub id)")
    path = str(_select(config, MODEL_KEY))
    local = os.path.expanduser(path)
    # An absolute or ./-relative path is a folder on this machine; "org/name" may be a hub id unless the hub is off.
    looks_local = os.path.isabs(local) or path.startswith((".", "~")) or os.path.exists(local)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if looks_local or offline:
        if not os.path.isdir(local):
            raise ConfigError(f"{MODEL_KEY}: no such directory {path!r}" + ("" if looks_local else
                              " (HF_HUB_OFFLINE is set, so it cannot be a hub id)"))
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ConfigError(f"{MODEL_KEY}: {path!r} holds no HF model (no config.json)")


FUSED_KEY = "actor_rollout_ref.model.use_fused_kernels"


def _check_fused_kernels(config: Any) -> None:
    """verl's fused LM-head kernels read ``lm_head.weight`` directly; when the head is not tied to the embeddings,
    verl's FSDP2 wrapping shards it as a unit of its own and that read fails at the first log-prob call ("mixed
    torch.Tensor and DTensor"), minutes into the run. A local model's config.json says which case it is."""
    if not _select(config, FUSED_KEY, False):
        return
    cfg_file = os.path.join(os.path.expanduser(str(_select(config, MODEL_KEY))), "config.json")
    try:
        with open(cfg_file) as f:
            tied = json.load(f).get("tie_word_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # a hub id, or no readable config: nothing to tell yet
    if tied is False:
        raise ConfigError(f"{FUSED_KEY}: verl's fused LM-head kernels fail under FSDP2 with an untied LM head "
                          f"(tie_word_embeddings is false in {cfg_file}); set it false (PopuLoRA's chunked "
                          "log-probs already avoid verl's per-token loop)")


def _check_gpus(config: Any) -> None:
    want = int(_select(config, "trainer.n_gpus_per_node", 1) or 0)
    nodes = int(_select(config, "trainer.nnodes", 1) or 1)
    device = str(_select(config, "trainer.device", "cuda") or "cuda")
    if device != "cuda" or want < 1:
        return
    import torch

    have = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    if have == 0:
        raise ConfigError(f"trainer.n_gpus_per_node: {want} GPU(s) requested but no GPU is visible{where}; "
                          "on a CPU machine use `python -m populora_verl.local`")
    if nodes == 1 and have < want:
        raise ConfigError(f"trainer.n_gpus_per_node: {want} GPUs requested but {have} visible{where}; "
                          f"set trainer.n_gpus_per_node={have}")


def preflight(config: Any, *, check_gpus: bool = True) -> None:
    """Every check that needs no worker: the ``populora.*`` section, the verl keys PopuLoRA depends on, the
    plugin's registrations, the model path and the GPUs. Raises :class:`ConfigError` (or ``RuntimeError`` for a
    broken install) with one line."""
    from populora_verl.config import load_config
    from populora_verl.trainer.convert import validate_verl_config

    pcfg = load_config(_select(config, "populora"))
    validate_verl_config(config, pcfg)
    from populora_verl.step.orchestration import small_group_warning

    warning = small_group_warning(pcfg)
    if warning:  # a setting that runs but cannot learn early on: say so before minutes of start-up
        print(f"populora: warning: {warning}", file=sys.stderr, flush=True)
    from populora_verl.trainer.schedule import scheduled_configs

    scheduled_configs(config)  # a population schedule (benchmarks): every entry valid before Ray starts
    _check_model_path(config)
    _check_fused_kernels(config)
    from populora_verl.plugin import check_registrations

    check_registrations()
    if check_gpus:
        _check_gpus(config)


class PreflightCallback(Callback):
    """Hydra callback: :func:`preflight` before the task function (verl's ``main``) runs."""

    def __init__(self, check_gpus: bool = True) -> None:
        self.check_gpus = check_gpus

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        try:
            preflight(config, check_gpus=self.check_gpus)
        except (ConfigError, RuntimeError) as e:
            print(f"populora: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
