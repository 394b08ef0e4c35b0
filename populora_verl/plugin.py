"""verl plugin entry point (``verl.plugins: populora = populora_verl.plugin``).

verl imports this module in every process at ``import verl`` and swallows import errors at DEBUG level, so:
nothing here may fail, nothing here imports vLLM (the rollout backend is registered through a lazy loader), and
:func:`check_registrations` lets the trainer fail at start-up with one clear line if a registration is missing.

Each registration runs in a process only once that process imports the verl module holding its registry
(``Registration.after``, through :func:`populora_verl.import_hooks.after_import`): at once where it is imported
already, else right after its import. ``import verl`` itself imports none of those modules, and most of a run's
processes (workers, the vLLM server, the load balancer) read one registry or none, so they no longer import the
trainer, the agent loop and the reward stack at ``import verl``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from types import ModuleType
from typing import Callable, NamedTuple

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


class Registration(NamedTuple):
    what: str  # the verl registry
    name: str  # our entry in it
    module: str  # our module whose ``function`` registers it
    function: str
    #: The verl module after whose import it registers: the package, not the registry module inside it, where the
    #: package's ``__init__`` imports that module. Importing a submodule runs its package's ``__init__`` first, so the
    #: package's end comes after the registry module's in every import order, and the registration meets the whole
    #: package executed (``from verl.trainer.ppo.v1 import get_trainer_cls``; ``.replica`` imported through ``.base``).
    after: str
    check: Callable[[str], bool]  # whether ``name`` is in the registry now

    @property
    def key(self) -> str:
        return f"{self.what}:{self.name}"


#: Order matters only for log readability.
REGISTRATIONS: list[Registration] = [
    # trainer_base: TRAINER_REGISTRY
    Registration(
        "trainer", "populora", "populora_verl.trainer", "register", "verl.trainer.ppo.v1", _in_trainer_registry
    ),
    Registration(
        "adv_estimator",
        "populora_trrpp",
        "populora_verl.advantage",
        "register",
        "verl.trainer.ppo.core_algos",  # ADV_ESTIMATOR_REGISTRY
        _in_adv_registry,
    ),
    Registration(
        "reward_manager",
        "populora_code",
        "populora_verl.reward.manager",
        "register",
        "verl.experimental.reward_loop.reward_manager",  # .registry: REWARD_MANAGER
        _in_reward_registry,
    ),
    Registration(
        "rollout",
        "populora_vllm",
        "populora_verl.rollout",
        "register_rollout",
        "verl.workers.rollout",  # .replica and .base: both halves of the backend
        _in_rollout_registry,
    ),
    Registration(
        "agent_loop",
        "populora_agent",
        "populora_verl.rollout",
        "register_agent_loop",
        "verl.experimental.agent_loop",  # .agent_loop: its registry
        _in_agent_loop_registry,
    ),
]

#: Back-compat view used by tests and messages: (registry, name).
EXPECTED: list[tuple[str, str]] = [(r.what, r.name) for r in REGISTRATIONS]

_errors: dict[str, str] = {}


#: Registrations whose verl module this process has not imported yet (``what:name``).
_pending: set[str] = set()


def _half_imported() -> str | None:
    """A module of ours that is in ``sys.modules`` but still executing, if any."""
    from populora_verl import import_hooks

    for name in list(sys.modules):
        if (name == "populora_verl" or name.startswith("populora_verl.")) and not import_hooks.is_imported(name):
            return name
    return None


def _register(r: Registration, _verl_module: ModuleType | None = None) -> None:
    """Run ``r``'s registration now (also the callback after the import of ``r.after``, which passes the module).

    Where a module of ours is half-way through its import (it imported the verl module whose end called this), the
    register function may not exist yet: an ImportError then leaves the registration pending, without a warning, and
    :func:`check_registrations` runs it once that import has finished (a real failure is reported there)."""
    _pending.discard(r.key)
    try:
        getattr(importlib.import_module(r.module), r.function)()
        _errors.pop(r.key, None)
    except Exception as e:  # keep going: check_registrations() reports the failure with its cause
        half = _half_imported() if isinstance(e, ImportError) else None
        if half is not None:  # see the docstring: not a failure yet
            _pending.add(r.key)
            logger.debug("populora plugin: %s %r waits for %s to finish its import", r.what, r.name, half)
            return
        _errors[r.key] = f"{type(e).__name__}: {e}"
        logger.warning("populora plugin: registering %s %r failed: %s", r.what, r.name, _errors[r.key])


def _register_lazily() -> None:
    """Each registration after the import of its verl module (``Registration.after``), now where it is imported."""
    from populora_verl import import_hooks

    for r in REGISTRATIONS:
        _pending.add(r.key)
        import_hooks.after_import(r.after, functools.partial(_register, r))


def _register_pending() -> None:
    """Import the verl modules of the registrations still waiting, which registers them."""
    from populora_verl import import_hooks

    for r in REGISTRATIONS:
        if r.key not in _pending:
            continue
        try:
            importlib.import_module(r.after)  # the import hook registers it, right after the module executed
        except Exception as e:
            _pending.discard(r.key)
            _errors[r.key] = f"importing {r.after}: {type(e).__name__}: {e}"
            continue
        import_hooks.run_pending(r.after)  # a module half-imported when the plugin was: its end was not seen
        if r.key in _pending:  # not through the hook (whatever kept it): register directly
            _register(r)


def registered() -> dict[str, bool]:
    """Which of :data:`EXPECTED` are present in verl's registries right now."""
    checks = {r.what: r.check for r in REGISTRATIONS}
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
        # A module of ours that was half-way through its import waits in _pending (see _register); what failed
        # otherwise may have met some other import half-way: those imports are over now, so it gets one more try.
        for r in REGISTRATIONS:
            if r.key in _errors:
                _register(r)
    missing = [k for k, ok in registered().items() if not ok]
    if missing:
        causes = "; ".join(f"{k}: {v}" for k, v in _errors.items() if k in missing)
        raise RuntimeError(
            f"populora_verl plugin not fully registered with verl: missing {missing}"
            + (f" ({causes})" if causes else "")
            + "; is `pip install -e .` done in this environment and VERL_USE_EXTERNAL_PLUGINS not 'none'?"
        )


_register_lazily()
