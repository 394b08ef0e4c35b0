"""verl plugin entry point (``verl.plugins: populora = populora_verl.plugin``).

verl imports this module in every process at ``import verl`` and swallows import errors at DEBUG level, so:
everything registers by side effect at import time, nothing here imports vLLM (the rollout backend is
registered through a lazy loader), and :func:`check_registrations` lets the trainer fail at start-up with one
clear line if a registration is missing.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Callable

logger = logging.getLogger(__name__)

# The first process to import the plugin is the command itself, before Ray starts: its start-up timeline begins here.
from populora_verl.trainer.timeline import record_start  # noqa: E402  (stdlib only)

record_start()


def _in_trainer_registry(name: str) -> bool:
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    return name in TRAINER_REGISTRY


def _in_reward_registry(name: str) -> bool:
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

    return name in REWARD_MANAGER


def _in_agent_loop_registry(name: str) -> bool:
    import verl.experimental.agent_loop.agent_loop as agent_mod

    from populora_verl.rollout import agent_loop_registered

    return agent_loop_registered(agent_mod, name)


def _in_rollout_registry(name: str) -> bool:
    from populora_verl.rollout import rollout_registered

    return rollout_registered(name)


def _in_adv_registry(name: str) -> bool:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    return name in ADV_ESTIMATOR_REGISTRY


#: (what, name, module whose ``register()`` registers it, check). Order matters only for log readability.
REGISTRATIONS: list[tuple[str, str, str, Callable[[str], bool]]] = [
    ("trainer", "populora", "populora_verl.trainer", _in_trainer_registry),
    ("adv_estimator", "populora_trrpp", "populora_verl.advantage", _in_adv_registry),
    ("reward_manager", "populora_code", "populora_verl.reward.manager", _in_reward_registry),
    ("rollout", "populora_vllm", "populora_verl.rollout", _in_rollout_registry),
    ("agent_loop", "populora_agent", "populora_verl.rollout", _in_agent_loop_registry),
]

#: Back-compat view used by tests and messages: (registry, name).
EXPECTED: list[tuple[str, str]] = [(what, name) for what, name, _, _ in REGISTRATIONS]

_errors: dict[str, str] = {}


def _register_all(only: Sequence[str] | None = None) -> None:
    for what, name, module, _ in REGISTRATIONS:
        key = f"{what}:{name}"
        if only is not None and key not in only:
            continue
        try:
            importlib.import_module(module).register()
            _errors.pop(key, None)
        except Exception as e:  # keep going: check_registrations() reports the failure with its cause
            _errors[key] = f"{type(e).__name__}: {e}"
            logger.warning("populora plugin: registering %s %r failed: %s", what, name, _errors[key])


def registered() -> dict[str, bool]:
    """Which of :data:`EXPECTED` are present in verl's registries right now."""
    checks = {what: check for what, _, _, check in REGISTRATIONS}
    out: dict[str, bool] = {}
    for what, name in EXPECTED:
        check = checks.get(what)
        try:
            out[f"{what}:{name}"] = bool(check and check(name))
        except Exception as e:
            _errors.setdefault(f"{what}:{name}", f"{type(e).__name__}: {e}")
            out[f"{what}:{name}"] = False
    return out


def check_registrations() -> None:
    """Raise ``RuntimeError`` (one line) if any PopuLoRA registration is missing from verl."""
    if _errors:
        # A module of ours imported before verl is half-loaded when verl's import loads this plugin (its register()
        # does not exist yet): by now that import has finished, so what failed gets one more try.
        _register_all(only=list(_errors))
    missing = [k for k, ok in registered().items() if not ok]
    if missing:
        causes = "; ".join(f"{k}: {v}" for k, v in _errors.items() if k in missing)
        raise RuntimeError(
            f"populora_verl plugin not fully registered with verl: missing {missing}"
            + (f" ({causes})" if causes else "")
            + "; is `pip install -e .` done in this environment and VERL_USE_EXTERNAL_PLUGINS not 'none'?"
        )


_register_all()
