"""verl plugin entry point (``verl.plugins: populora = populora_verl.plugin``).

verl imports this module in every process at ``import verl`` and swallows import errors at DEBUG level, so:
nothing here may fail, nothing here imports vLLM (the rollout backend is registered through a lazy loader), and
:func:`check_registrations` lets the trainer fail at start-up with one clear line if a registration is missing.

Each registration runs in a process only once that process imports the verl module holding its registry
(:data:`AFTER_IMPORT`, through :func:`populora_verl.import_hooks.after_import`): at once where it is imported
already, else right after its import. ``import verl`` itself imports none of those modules, and most of a run's
processes (workers, the vLLM server, the load balancer) read one registry or none, so they no longer import the
trainer, the agent loop and the reward stack at ``import verl``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from types import ModuleType
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


#: (what, name, module whose function of :data:`AFTER_IMPORT` (``register()`` but for the rollout's two) registers
#: it, check). Order matters only for log readability.
REGISTRATIONS: list[tuple[str, str, str, Callable[[str], bool]]] = [
    ("trainer", "populora", "populora_verl.trainer", _in_trainer_registry),
    ("adv_estimator", "populora_trrpp", "populora_verl.advantage", _in_adv_registry),
    ("reward_manager", "populora_code", "populora_verl.reward.manager", _in_reward_registry),
    ("rollout", "populora_vllm", "populora_verl.rollout", _in_rollout_registry),
    ("agent_loop", "populora_agent", "populora_verl.rollout", _in_agent_loop_registry),
]

#: what -> (the verl module after whose import it registers, the function of its REGISTRATIONS module that does).
#: Packages, not the registry modules inside them, where the package's ``__init__`` imports the registry module:
#: importing a submodule runs its package's ``__init__`` first, so the package's end comes after the registry
#: module's in every import order, and the registration meets the whole package (``from verl.trainer.ppo.v1 import
#: get_trainer_cls``, ``verl.workers.rollout.replica`` imported by way of ``.base``) executed.
AFTER_IMPORT: dict[str, tuple[str, str]] = {
    "trainer": ("verl.trainer.ppo.v1", "register"),  # trainer_base: TRAINER_REGISTRY
    "adv_estimator": ("verl.trainer.ppo.core_algos", "register"),  # ADV_ESTIMATOR_REGISTRY
    "reward_manager": ("verl.experimental.reward_loop.reward_manager", "register"),  # .registry: REWARD_MANAGER
    "rollout": ("verl.workers.rollout", "register_rollout"),  # .replica and .base: both halves of the backend
    "agent_loop": ("verl.experimental.agent_loop", "register_agent_loop"),  # .agent_loop: its registry
}

#: Back-compat view used by tests and messages: (registry, name).
EXPECTED: list[tuple[str, str]] = [(what, name) for what, name, _, _ in REGISTRATIONS]

_errors: dict[str, str] = {}


#: Registrations whose verl module this process has not imported yet (``what:name``).
_pending: set[str] = set()


def _register(what: str, name: str, module: str) -> None:
    key = f"{what}:{name}"
    _pending.discard(key)
    try:
        getattr(importlib.import_module(module), AFTER_IMPORT[what][1])()
        _errors.pop(key, None)
    except Exception as e:  # keep going: check_registrations() reports the failure with its cause
        _errors[key] = f"{type(e).__name__}: {e}"
        logger.warning("populora plugin: registering %s %r failed: %s", what, name, _errors[key])


def _after_import(what: str, name: str, module: str, _verl_module: ModuleType) -> None:
    _register(what, name, module)


def _register_all(only: Sequence[str] | None = None) -> None:
    """Register now (importing verl's registry modules) every entry, or those of ``only`` (``what:name`` keys)."""
    for what, name, module, _ in REGISTRATIONS:
        if only is None or f"{what}:{name}" in only:
            _register(what, name, module)


def _register_lazily() -> None:
    """Each registration after the import of its verl module (:data:`AFTER_IMPORT`), now where it is imported."""
    from populora_verl import import_hooks

    for what, name, module, _ in REGISTRATIONS:
        _pending.add(f"{what}:{name}")
        import_hooks.after_import(AFTER_IMPORT[what][0], functools.partial(_after_import, what, name, module))


def _register_pending() -> None:
    """Import the verl modules of the registrations still waiting, which registers them."""
    from populora_verl import import_hooks

    for what, name, module, _ in REGISTRATIONS:
        key = f"{what}:{name}"
        if key not in _pending:
            continue
        after = AFTER_IMPORT[what][0]
        try:
            importlib.import_module(after)  # the import hook registers it, right after the module executed
        except Exception as e:
            _pending.discard(key)
            _errors[key] = f"importing {after}: {type(e).__name__}: {e}"
            continue
        import_hooks.run_pending(after)  # a module half-imported when the plugin was: its end was not seen
        if key in _pending:  # not through the hook (whatever kept it): register directly
            _register(what, name, module)


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
    """Raise ``RuntimeError`` (one line) if any PopuLoRA registration is missing from verl. Imports the verl modules of
    the registrations still waiting for theirs, which registers them."""
    _register_pending()
    if _errors:
        # A module of ours imported before verl can be half-loaded when the import of a registry module registers it
        # (its register() does not exist yet): by now that import has finished, so what failed gets one more try.
        _register_all(only=list(_errors))
    missing = [k for k, ok in registered().items() if not ok]
    if missing:
        causes = "; ".join(f"{k}: {v}" for k, v in _errors.items() if k in missing)
        raise RuntimeError(
            f"populora_verl plugin not fully registered with verl: missing {missing}"
            + (f" ({causes})" if causes else "")
            + "; is `pip install -e .` done in this environment and VERL_USE_EXTERNAL_PLUGINS not 'none'?"
        )


_register_lazily()
