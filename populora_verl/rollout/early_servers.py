"""vLLM's server actors started with the trainer's set-up, beside the FSDP workers, instead of after them.

verl creates a replica's server actor once the FSDP worker group has loaded its model, and the actor's process then
spends its first 23-26 s importing verl's and vLLM's server modules (BENCHMARKS.md §5: the import probe). Both are
Ray processes of their own, so nothing but verl's order keeps them apart. With ``trainer.populora_early_servers``
the trainer creates every replica's server actor at the beginning of ``init()``, under the name verl will give it,
with its construction deferred (:func:`defer`): the process starts and imports while the FSDP workers start. When
verl's replica later asks its server class for that actor (``server_class.options(...).remote(...)``), the class
installed by :func:`wrap` hands over the waiting actor and runs its real construction with verl's arguments
(``populora_init``) instead of starting a new process. The engine itself still starts when verl launches it, after
the FSDP model is loaded, so vLLM's memory check sees the trainer's memory as before.

An actor is handed over only where verl asks for exactly the options it was created with (name, node, environment,
concurrency); on any difference verl's own path runs, after the waiting actor is ended and its name freed. A multi-node
run, another rollout backend or a replica spanning nodes keeps verl's order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "ENABLE_KEY",
    "EarlyServers",
    "DeferredInit",
    "defer",
    "wrap",
    "server_names",
    "server_options",
]

ENABLE_KEY = "trainer.populora_early_servers"
DEFER_KWARG = "populora_deferred"
#: how long a hand-over waits for the early actors to be created, and for a refused actor's name to be freed
WAIT_S = 120.0

#: the early servers of this process (the task runner builds the trainer and verl's replicas in one process)
_ACTIVE: EarlyServers | None = None


def defer(server: Any, kwargs: dict[str, Any]) -> bool:
    """In a server's ``__init__``: True (construction skipped) when created with ``populora_deferred=True``."""
    if kwargs.pop(DEFER_KWARG, False):
        server._populora_deferred = True
        return True
    return False


class DeferredInit:
    """``populora_init``: the construction a deferred actor skipped, with the arguments verl passes its server."""

    def populora_init(self, *args: Any, **kwargs: Any) -> None:
        if not getattr(self, "_populora_deferred", False):
            raise RuntimeError(f"{type(self).__name__}.populora_init: the server is constructed already")
        self._populora_deferred = False
        self.__init__(*args, **kwargs)


def server_names(config: Any) -> list[str] | None:
    """The names verl gives the rollout servers of ``config`` (one per replica, one node each), or None where the
    early start does not apply (another backend, several nodes, a replica over several nodes, no hybrid engine)."""
    from populora_verl.config import load_config
    from populora_verl.rollout import BACKEND_NAME
    from populora_verl.trainer.verl_config import parallel_layout, select

    ar = "actor_rollout_ref"
    if select(config, f"{ar}.rollout.name") != BACKEND_NAME or not select(config, f"{ar}.hybrid_engine", True):
        return None
    layout = parallel_layout(config, load_config(select(config, "populora")))
    if layout.nnodes != 1:
        return None
    return [f"{BACKEND_NAME}_server_{rank}_0" for rank in range(layout.replicas)]


def server_options(config: Any, name: str, node_id: str) -> dict[str, Any]:
    """The Ray options verl's replica creates the server ``name`` with on ``node_id`` (its ``launch_servers``)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from verl.plugin.platform import get_platform
    from verl.workers.rollout.replica import CONTROL_METHOD_CONCURRENCY

    from populora_verl.trainer.verl_config import select

    platform = get_platform()
    max_num_seqs = int(select(config, "actor_rollout_ref.rollout.max_num_seqs", 0) or 0)
    return {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        "runtime_env": {"env_vars": {**{v: "1" for v in platform.ray_noset_envvars()}, **platform.rollout_env_vars()}},
        "name": name,
        "max_concurrency": max(1000, max_num_seqs + CONTROL_METHOD_CONCURRENCY),
    }


def _same(ours: Mapping[str, Any], verls: Mapping[str, Any]) -> bool:
    def plain(opts: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(opts)
        strategy = out.pop("scheduling_strategy", None)
        out["node"] = (getattr(strategy, "node_id", strategy), getattr(strategy, "soft", None))
        return out

    return plain(ours) == plain(verls)


class EarlyServers:
    """The server actors created early, by name, until verl's replicas take them (:meth:`take`)."""

    def __init__(self, config: Any, server_class: Callable[[], Any], node_id: str, names: list[str]) -> None:
        self._config, self._load_class, self._node_id = config, server_class, node_id
        self.names = list(names)
        self._actors: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._error: BaseException | None = None
        # No actor is created once a hand-over gave up waiting or the set-up ended: verl may have created its own
        # under the name by then.
        self._lock = threading.Lock()
        self._closed = False
        self.taken: list[str] = []
        self.started_at = time.monotonic()
        # Creating an actor needs its class in this process, and the class's module imports vLLM (seconds): in a
        # thread, so that the trainer's set-up goes on meanwhile.
        self._thread = threading.Thread(target=self._create, name="populora-early-servers", daemon=True)
        self._thread.start()

    def _create(self) -> None:
        import ray

        try:
            remote_cls = ray.remote(self._load_class())
            for name in self.names:
                opts = server_options(self._config, name, self._node_id)
                with self._lock:
                    if self._closed:
                        return
                    self._actors[name] = (remote_cls.options(**opts).remote(**{DEFER_KWARG: True}), opts)
        except BaseException as e:  # noqa: BLE001 - any failure only means verl's order
            self._error = e

    def take(self, options: Mapping[str, Any]) -> Any | None:
        """The waiting actor verl asks for with ``options``, or None (then verl creates its own under that name)."""
        self._thread.join(WAIT_S)
        name = options.get("name")
        with self._lock:
            self._closed = self._closed or self._thread.is_alive()
            entry = self._actors.pop(name, None)
        if entry is None:
            if self._error is not None:
                logger.warning("[populora] early vLLM servers not started (%r): verl's order", self._error)
            return None
        handle, ours = entry
        if _same(ours, options):
            self.taken.append(name)
            return handle
        logger.warning("[populora] early vLLM server %s: verl asks for other options; verl's own is started", name)
        _end(handle, name)
        return None

    def finish(self) -> str:
        """End the actors no replica took; the start-up line's summary."""
        import ray

        with self._lock:
            self._closed = True
            left, self._actors = list(self._actors.values()), {}
        for handle, _ in left:
            ray.kill(handle, no_restart=True)
        if self._error is not None:
            return f"vLLM server actors: not started early ({type(self._error).__name__}: {self._error}); verl's order"
        return (
            f"vLLM server actors: {len(self.taken)} of {len(self.names)} started with the trainer's set-up and taken "
            f"by verl's replicas ({time.monotonic() - self.started_at:.0f} s after their start)"
        )


def _end(handle: Any, name: str) -> None:
    """Kill ``handle`` and wait until its name is free, so that verl can create an actor under it."""
    import ray

    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        time.sleep(0.2)
    logger.warning("[populora] early vLLM server %s: its name is still taken after %.0f s", name, WAIT_S)


def start(config: Any, server_class: Callable[[], Any]) -> EarlyServers | None:
    """Create the early server actors of ``config`` (when it applies) and install them for :func:`wrap`;
    ``server_class`` returns the servers' class (it is called in a thread: its module imports vLLM)."""
    global _ACTIVE
    import ray

    finish()  # an earlier trainer's, never taken: ended, not handed to this one
    names = server_names(config)
    if not names:
        return None
    _ACTIVE = EarlyServers(config, server_class, ray.get_runtime_context().get_node_id(), names)
    return _ACTIVE


def finish() -> str | None:
    """Uninstall the early servers (ending those not taken); their summary line, None when there were none."""
    global _ACTIVE
    active, _ACTIVE = _ACTIVE, None
    return active.finish() if active is not None else None


class _EarlyServerClass:
    """A Ray actor class whose ``options(...).remote(...)`` hands over a waiting early actor where one matches."""

    def __init__(self, remote_cls: Any, early: EarlyServers) -> None:
        self._cls, self._early = remote_cls, early

    def options(self, **options: Any) -> _Launch:
        return _Launch(self._cls, self._early, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)


class _Launch:
    def __init__(self, remote_cls: Any, early: EarlyServers, options: dict[str, Any]) -> None:
        self._cls, self._early, self._options = remote_cls, early, options

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        import ray

        handle = self._early.take(self._options)
        if handle is None:
            return self._cls.options(**self._options).remote(*args, **kwargs)
        # verl calls the server's methods next: its construction must be done first (a few ms of its own work)
        ray.get(handle.populora_init.remote(*args, **kwargs))
        return handle


def wrap(remote_cls: Any) -> Any:
    """``remote_cls``, or a class handing over the early actors when the trainer started some."""
    return remote_cls if _ACTIVE is None else _EarlyServerClass(remote_cls, _ACTIVE)
