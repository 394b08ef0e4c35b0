"""Start-up checks that run before Ray and TransferQueue start.

``python -m verl.trainer.main_ppo`` starts Ray, TransferQueue and the workers before our trainer class is built,
so a missing model or a machine without GPUs used to show up minutes later, or as a silent hang. The recipes
declare :class:`PreflightCallback` as a Hydra callback (``hydra.callbacks.populora_preflight`` in
``recipes/populora/populora_base.yaml``; a verl config of one's own adds the same key, docs/from-grpo.md). Hydra
calls its ``on_run_start`` with the composed config, where ``populora.enable=true`` sets the verl keys a
PopuLoRA run needs, then its ``on_job_start`` before verl's ``main``; a failed check ends the command with one
line naming the key (exit status 2).
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
#: verl's ppo_trainer default for MODEL_KEY, which no PopuLoRA recipe means to run
VERL_DEFAULT_MODEL = "~/models/deepseek-llm-7b-chat"


def _select(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=default, throw_on_missing=False)


def _check_model_path(config: Any) -> None:
    from omegaconf import OmegaConf

    path = None if OmegaConf.is_missing(config, "actor_rollout_ref") else _select(config, MODEL_KEY)
    # A recipe's "???" does not override a value below it, so a recipe without a model ends up with verl's own
    # placeholder default: say that the model is missing rather than that verl's placeholder folder is.
    if path is None or str(path) == VERL_DEFAULT_MODEL:
        raise ConfigError(f"{MODEL_KEY}: is required (a local HF model folder or a hub id; docs/models.md)")
    path = str(path)
    local = os.path.expanduser(path)
    # An absolute or ./-relative path is a folder on this machine; "org/name" may be a hub id unless the hub is off.
    looks_local = os.path.isabs(local) or path.startswith((".", "~")) or os.path.exists(local)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if looks_local or offline:
        if not os.path.isdir(local):
            raise ConfigError(
                f"{MODEL_KEY}: no such directory {path!r}"
                + ("" if looks_local else " (HF_HUB_OFFLINE is set, so it cannot be a hub id)")
            )
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
        raise ConfigError(
            f"{FUSED_KEY}: verl's fused LM-head kernels fail under FSDP2 with an untied LM head "
            f"(tie_word_embeddings is false in {cfg_file}); set it false (PopuLoRA's chunked "
            "log-probs already avoid verl's per-token loop)"
        )


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
        raise ConfigError(
            f"trainer.n_gpus_per_node: {want} GPU(s) requested but no GPU is visible{where}; "
            "on a CPU machine use `python -m populora_verl.local`"
        )
    if nodes == 1 and have < want:
        raise ConfigError(
            f"trainer.n_gpus_per_node: {want} GPUs requested but {have} visible{where}; "
            f"set trainer.n_gpus_per_node={have}"
        )


def _check_vllm() -> None:
    """verl imports vLLM in the rollout workers, after Ray and the workers have started."""
    from populora_verl.checks import vllm_missing

    missing = vllm_missing()
    if missing:
        raise ConfigError(f"actor_rollout_ref.rollout.name: {missing}")


ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
COMPILE_CACHE_KEY = f"{ENV_VARS_KEY}.VLLM_DISABLE_COMPILE_CACHE"
#: the first torch that writes inductor artifacts atomically; before it, engines compiling at once could leave a
#: corrupt entry in a shared cache, which is why verl turns vLLM's compile cache off by default
ATOMIC_CACHE_TORCH = (2, 10)


def _check_ray_env_vars(config: Any) -> None:
    """Ray takes only strings as environment values, and says so after the command has started Ray; an override
    such as ``...env_vars.X=1`` reaches it as an int unless quoted."""
    from omegaconf import OmegaConf

    env = _select(config, ENV_VARS_KEY)
    if env is None:
        return
    for name, value in OmegaConf.to_container(env, resolve=True).items():
        if not isinstance(value, str):
            raise ConfigError(
                f"{ENV_VARS_KEY}.{name}: Ray needs a string, got {value!r}; quote it ({ENV_VARS_KEY}.{name}='{value}')"
            )


def _check_compile_cache(config: Any) -> None:
    """The recipes turn vLLM's torch.compile cache back on (a node's later runs skip compilation); that is only
    safe where torch writes the cache atomically."""
    value = _select(config, COMPILE_CACHE_KEY)
    if value is None or str(value).strip().lower() in ("1", "true", "yes"):
        return
    import torch

    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if release < ATOMIC_CACHE_TORCH:
        need = ".".join(map(str, ATOMIC_CACHE_TORCH))
        raise ConfigError(
            f"{COMPILE_CACHE_KEY}: the compile cache needs torch >= {need} (atomic cache writes), "
            f'this is torch {torch.__version__}; set it to "1"'
        )


LIGER_KEY = "actor_rollout_ref.model.use_liger"


def _check_liger(config: Any) -> None:
    """verl imports Liger's kernels inside each FSDP worker, after Ray and the workers have started: a missing
    package would surface minutes in, as a worker's traceback."""
    if not _select(config, LIGER_KEY, False):
        return
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            f"{LIGER_KEY}: the liger-kernel package is not installed (pip install liger-kernel), or set it false"
        )


ATTENTION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"


def _flash_attn_2_available() -> bool:
    import importlib.util

    # the package, not transformers' full check: importing transformers here would lengthen every launch
    return importlib.util.find_spec("flash_attn") is not None


def _check_attention(config: Any) -> None:
    """verl builds the FSDP model with flash-attn 2 unless the override names another attention; without the package
    transformers refuses in each worker's model init, minutes in (a node without a flash-attn wheel for its torch)."""
    if (_select(config, ATTENTION_KEY) or "flash_attention_2") != "flash_attention_2" or _flash_attn_2_available():
        return
    raise ConfigError(
        f"{ATTENTION_KEY}: verl's default flash_attention_2 needs the flash-attn package, not usable here; install it, "
        f"or set ++{ATTENTION_KEY}=populora_varlen (packed training attention without flash-attn) or sdpa"
    )


def preflight(config: Any, *, check_gpus: bool = True) -> None:
    """Every check that needs no worker: the ``populora.*`` section and what it names (operators, the seed file),
    the verl keys PopuLoRA depends on, the plugin's registrations, the model path, the GPUs, vLLM and the attention
    kernels. Raises :class:`ConfigError` (or ``RuntimeError`` for a broken install) with one line."""
    from populora_verl.config import load_config
    from populora_verl.trainer.verl_config import validate_verl_config

    pcfg = load_config(_select(config, "populora"))
    validate_verl_config(config, pcfg)
    from populora_verl.step.compute import check_compute_plan

    check_compute_plan(pcfg)  # every adapter of a role trains alike on every step (docs/tasks-and-rewards.md)
    from populora_verl.step.metrics import small_group_warning

    warning = small_group_warning(pcfg)
    if warning:  # a setting that runs but cannot learn early on: say so before minutes of start-up
        print(f"populora: warning: {warning}", file=sys.stderr, flush=True)
    from populora_verl.trainer.schedule import scheduled_configs

    scheduled_configs(config)  # a population schedule (benchmarks): every entry valid before Ray starts
    from populora_verl.checks import check_device, check_population_inputs

    check_population_inputs(pcfg)  # operator names and the seed file: used only minutes in, at their first use
    check_device(_select(config, "trainer.device", "cuda"))
    _check_model_path(config)
    _check_fused_kernels(config)
    _check_liger(config)
    _check_ray_env_vars(config)
    _check_compile_cache(config)
    from populora_verl.plugin import check_registrations

    check_registrations()
    if check_gpus:  # what this machine has: GPUs, and the vLLM every PopuLoRA rollout runs on
        _check_gpus(config)
        _check_vllm()
        _check_attention(config)


RUN_DIR_KEY = "trainer.default_local_dir"


def claim_trainer_run_dir(config: Any) -> Any:
    """Lock ``trainer.default_local_dir`` for this command (:mod:`populora_verl.runlock`), resolved as the trainer
    resolves it (relative to the working directory). Raises :class:`~populora_verl.runlock.RunDirInUse`."""
    from populora_verl.runlock import claim_run_dir

    root = str(_select(config, RUN_DIR_KEY))  # no expanduser: the trainer takes the string as it is
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"{RUN_DIR_KEY}: {root!r} is a file, not a directory")
    root = root if os.path.isabs(root) else os.path.join(os.getcwd(), root)
    return claim_run_dir(root, what=RUN_DIR_KEY, command="python -m verl.trainer.main_ppo " + " ".join(sys.argv[1:]))


def _remove_hydra_output_dir(config: Any) -> None:
    """A start that failed here has written nothing but Hydra's own record of the job (``.hydra/`` and the job
    log) into a fresh ``outputs/DATE/TIME/``: remove that, and the date folder and ``outputs/`` if left empty, so
    failed starts do not pile up folders. A folder holding anything else, or the working directory, is kept."""
    import shutil

    out = _select(config, "hydra.runtime.output_dir")
    if not out:
        return
    out, cwd = os.path.realpath(str(out)), os.path.realpath(os.getcwd())
    if out == cwd or not out.startswith(cwd + os.sep) or not os.path.isdir(out):
        return
    entries = os.listdir(out)
    if any(e != ".hydra" and not e.endswith(".log") for e in entries):
        return
    shutil.rmtree(out, ignore_errors=True)
    parent = os.path.dirname(out)
    while parent != cwd and parent.startswith(cwd + os.sep):
        try:
            os.rmdir(parent)  # only while empty
        except OSError:
            break
        parent = os.path.dirname(parent)


def _stop(e: BaseException, config: Any = None) -> None:
    print(f"populora: {e}", file=sys.stderr, flush=True)
    if config is not None:
        _remove_hydra_output_dir(config)
    raise SystemExit(2) from None


class PreflightCallback(Callback):
    """Hydra callback. ``on_run_start``: with ``populora.enable=true``, set the verl keys a PopuLoRA run needs
    (:mod:`populora_verl.trainer.enable`) on the composed config, which Hydra then hands to verl's ``main``.
    ``on_job_start``: :func:`preflight` before verl's ``main`` runs, then the run directory's lock, held by this
    process (which waits for the whole run) until the job ends. A config that is not a PopuLoRA run (no
    ``populora.enable``, trainer mode not ``populora``) passes through both untouched: it runs as plain verl."""

    def __init__(self, check_gpus: bool = True) -> None:
        self.check_gpus = check_gpus
        self.lock: Any = None
        # TransferQueue, started here once verl starts Ray (trainer.populora_early_transfer_queue)
        self.early_tq: Any = None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        # Hydra deep-copies this config for the task function only after on_run_start, so what is set here is what
        # verl's main, its validate_config, Ray and the trainer read. (on_job_start's config is not: the copy is
        # made before it runs.)
        from populora_verl.trainer.enable import apply_populora_settings, describe, is_enabled

        try:
            if not is_enabled(config):
                return
            changes = apply_populora_settings(config)
        except ConfigError as e:
            _stop(e)
        if changes:
            print(describe(changes), flush=True)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from populora_verl.runlock import RunDirInUse
        from populora_verl.trainer.enable import ENABLE_KEY, apply_populora_settings, describe, is_enabled

        try:
            if not is_enabled(config):
                return
            pending = apply_populora_settings(config, dry_run=True)
            if pending:
                # Only on_run_start can change what verl's main gets, and Hydra's --multirun never calls it.
                raise ConfigError(
                    f"{ENABLE_KEY}: these keys were not set before the job started (hydra "
                    f"--multirun skips the callback that sets them); put them in the config: "
                    f"{describe(pending).split(': ', 1)[1]}"
                )
            preflight(config, check_gpus=self.check_gpus)
            self.lock = claim_trainer_run_dir(config)
        except (ConfigError, RuntimeError, RunDirInUse) as e:
            _stop(e, config)
        from populora_verl.trainer import early_transfer_queue

        self.early_tq = early_transfer_queue.start(config)

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        if self.early_tq is not None:
            self.early_tq.finish()
            self.early_tq = None
        if self.lock is not None:
            # A run that failed before writing anything leaves no empty run directory behind.
            self.lock.finish()
            self.lock = None
