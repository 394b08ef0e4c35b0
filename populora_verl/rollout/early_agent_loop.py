"""The rollout's client side starts while vLLM starts, not at step 1's first hand-off.

verl's task runner creates its agent-loop workers (Ray actors that import verl, load the tokenizer and connect to
TransferQueue) only after ``trainer.init()`` has brought the vLLM servers up, and step 1's first
``generate_sequences`` waits for their processes to start (24-37 s measured). The request load balancer that routes
their requests to the servers is a Ray actor too, created by verl once the servers are up; its process imports verl's
rollout package, and step 1's first request waited 23-28 s for it on an H200 (its first log line against the end of
``init``), with or without the workers started early. Here the trainer starts both at the beginning of its ``init()``:
the workers without server handles, the balancer with no servers, so their imports and set-up run beside the worker
groups' and vLLM's start. Once the servers are up, the trainer gives the early balancer verl's servers and puts it in
place of the one verl has just created (:func:`adopt_load_balancer`); the task runner's manager (verl's
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``, which the trainer points at
:class:`EarlyAgentLoopManager`) then binds the LLM client and the reward workers' handles.

The recipes turn it on (``trainer.populora_early_agent_loop: true`` in ``populora_base.yaml``; on one H200 step 1 took
37 s against verl's order's 65 s, BENCHMARKS.md §5); a config without the key keeps verl's order, and so does
``trainer.populora_early_agent_loop=false`` (arm A of ``populora_verl.bench.startup --lever early_agent_loop``). A
manager class set by the user, or distillation (its teacher client is needed at construction), keeps verl's order
for the workers; a router of the user's (``actor_rollout_ref.rollout.router_config_path``) keeps verl's balancer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

logger = logging.getLogger(__name__)

__all__ = [
    "EARLY_KEY",
    "MANAGER_KEY",
    "MANAGER_FQN",
    "WATCHED_SECTIONS",
    "UnboundClient",
    "EarlyAgentLoopWorker",
    "EarlyAgentLoopManager",
    "configure",
    "start",
    "take",
    "create_workers",
    "EarlyRequestLoadBalancer",
    "start_load_balancer",
    "adopt_load_balancer",
]

#: ``trainer.populora_early_agent_loop``: true (the recipes), the client side started with the trainer's set-up;
#: false or absent: verl's order (workers and balancer created after the servers are up).
EARLY_KEY = "trainer.populora_early_agent_loop"
#: verl's key for a custom agent-loop manager (declared by ``verl.workers.config.AgentLoopConfig``).
MANAGER_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
MANAGER_FQN = "populora_verl.rollout.early_agent_loop.EarlyAgentLoopManager"
#: How long the hand-off waits for the early balancer (its process is up 20-30 s after its start, and the hand-off comes
#: minutes later); past it, verl's balancer is used.
ADOPT_TIMEOUT_S = 300.0
#: The config sections verl's agent-loop worker reads at construction. The trainer's set-up may change others (the
#: actor's optimizer; ``reward.reward_model.nnodes``, which verl's resource-pool set-up fills in): later reads go
#: through the config that binding hands over. A change in one of these between the early start and the binding
#: rebuilds the worker's state from the final config (the imports, the slow part, are done by then).
WATCHED_SECTIONS = ("actor_rollout_ref.rollout", "actor_rollout_ref.model", "data", "distillation")


def _distillation(config: DictConfig) -> bool:
    return bool(OmegaConf.select(config, "distillation.enabled", default=False))


def configure(config: DictConfig) -> bool:
    """Point verl's agent-loop manager key at :class:`EarlyAgentLoopManager` when the early start is on; returns
    whether it did. Called by the trainer's constructor, before the task runner reads the key."""
    if not bool(OmegaConf.select(config, EARLY_KEY, default=False)):
        return False
    current = OmegaConf.select(config, MANAGER_KEY, default=None)
    if current not in (None, MANAGER_FQN):
        print(f"[populora] {MANAGER_KEY}={current}: the agent-loop workers start at verl's point", flush=True)
        return False
    if _distillation(config):
        return False
    with open_dict(config):
        OmegaConf.update(config, MANAGER_KEY, MANAGER_FQN, force_add=True)
    return True


@dataclass
class _Started:
    workers: list[Any]
    load_balancer: Any = None  # verl's request load balancer with no servers yet; None: verl's own is kept
    at: float = field(default_factory=time.time)


_STARTED: _Started | None = None


def _node_ids() -> list[str]:
    """verl's placement: every live node with CPUs, round robin."""
    return [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]


def worker_class() -> Any:
    """The Ray actor class of the workers (``ray.remote`` of :class:`EarlyAgentLoopWorker`)."""
    return ray.remote(EarlyAgentLoopWorker)


def create_workers(config: DictConfig, worker_cls: Any, args: tuple = (), node_ids: list[str] | None = None) -> list:
    """``agent.num_workers`` actors placed as verl places them; ``args`` follow the config in the constructor (none:
    unbound). ``.remote`` returns at once: each actor's process starts and runs its constructor in the background."""
    n = int(OmegaConf.select(config, "actor_rollout_ref.rollout.agent.num_workers"))
    nodes = node_ids if node_ids is not None else _node_ids()
    workers = []
    for i in range(n):
        options: dict[str, Any] = {"name": f"agent_loop_worker_{i}_{uuid4().hex[:8]}"}
        if nodes:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)], soft=True)
        workers.append(worker_cls.options(**options).remote(config, *args))
    return workers


def start(config: DictConfig, worker_cls: Any = None, node_ids: list[str] | None = None) -> bool:
    """Start the rollout's client side now, when the early start is on: the agent-loop workers, unbound, when the
    config names :class:`EarlyAgentLoopManager` (set by :func:`configure`), and the request load balancer with no
    servers unless a router of the user's is configured. The manager built by the task runner takes the workers
    (:func:`take`); the trainer hands the servers to the balancer (:func:`adopt_load_balancer`). Returns whether it
    started anything."""
    global _STARTED
    if _STARTED is not None:  # an earlier trainer's, never taken: ended, not handed to this one
        for handle in (*_STARTED.workers, _STARTED.load_balancer):
            if handle is not None:
                ray.kill(handle)
        _STARTED = None
    if not bool(OmegaConf.select(config, EARLY_KEY, default=False)):
        return False
    workers: list[Any] = []
    if OmegaConf.select(config, MANAGER_KEY, default=None) == MANAGER_FQN and not _distillation(config):
        workers = create_workers(config, worker_cls if worker_cls is not None else worker_class(), (), node_ids)
    balancer = start_load_balancer(config)
    if not workers and balancer is None:
        return False
    _STARTED = _Started(workers, balancer)
    return True


class EarlyRequestLoadBalancer(GlobalRequestLoadBalancer):
    """verl's default request load balancer (the same routing), started before the servers exist. Its constructor
    also imports the rollout backend's module: to rebuild the servers' actor handles that ``add_servers`` receives,
    Ray loads their class, so without this the hand-off paid for importing vLLM (9-11 s on an H200)."""

    def __init__(
        self,
        servers: dict[str, Any],
        max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE,
        full_determinism: bool = False,
        backend: tuple[str, bool] | None = None,
    ) -> None:
        super().__init__(servers, max_cache_size=max_cache_size, full_determinism=full_determinism)
        if backend is not None:
            from verl.workers.rollout.replica import get_rollout_replica_class

            try:
                get_rollout_replica_class(*backend)
            except Exception as e:  # only a head start: the hand-off imports it again and fails there as verl's would
                logger.warning("request load balancer: rollout backend %s not imported early (%r)", backend[0], e)


def balancer_class() -> Any:
    """The Ray actor class of the early balancer (``ray.remote`` of :class:`EarlyRequestLoadBalancer`)."""
    return ray.remote(EarlyRequestLoadBalancer)


def start_load_balancer(config: DictConfig) -> Any:
    """The request load balancer, created now with no servers (it takes them later through ``add_servers``); None
    when ``rollout.router_config_path`` names a router of the user's, which verl builds."""
    rollout = OmegaConf.select(config, "actor_rollout_ref.rollout")
    if rollout is None or rollout.get("router_config_path"):
        return None
    name = rollout.get("name")
    disaggregated = bool(OmegaConf.select(rollout, "disaggregation.enabled", default=False))
    return balancer_class().remote(
        servers={},
        full_determinism=bool(rollout.get("full_determinism", False)),
        backend=(str(name), disaggregated) if name else None,
    )


def adopt_load_balancer(manager: Any) -> bool:
    """Once verl's ``LLMServerManager`` has its servers up: give them to the balancer started early and put it in
    place of the one verl created (which is ended), so step 1's first request finds its process running. Returns
    whether it did; an early balancer that failed leaves verl's in place, with a line saying so."""
    started = _STARTED
    if started is None or started.load_balancer is None:
        return False
    balancer, started.load_balancer = started.load_balancer, None
    servers = dict(zip(manager.server_addresses, manager.server_handles, strict=True))
    t0 = time.time()
    try:
        ray.get(balancer.add_servers.remote(servers), timeout=ADOPT_TIMEOUT_S)
    except RayError as e:  # its process died or never came up (GetTimeoutError is one too)
        print(f"[populora] request load balancer started early failed ({type(e).__name__}): verl's is used", flush=True)
        ray.kill(balancer)
        return False
    verls, manager.global_load_balancer = manager.global_load_balancer, balancer
    ray.kill(verls)
    print(
        f"[populora] request load balancer: started with the trainer's set-up, {len(servers)} "
        f"server{'' if len(servers) == 1 else 's'} added in "
        f"{time.time() - t0:.1f} s ({time.time() - started.at:.0f} s after its start)",
        flush=True,
    )
    return True


def take() -> _Started | None:
    """The workers :func:`start` started for this process's trainer (once; None when none were started): one
    trainer per task-runner process."""
    global _STARTED
    started, _STARTED = _STARTED, None
    return started


class UnboundClient:
    """The LLM client of a worker started before the servers are up. verl sets ``tokenizer`` on it (traces); any
    other use is a bug: the manager binds the real client before the first hand-off."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"agent-loop worker used before its LLM client was bound ({name!r})")


def _sections(config: Any) -> dict[str, Any]:
    return {
        key: OmegaConf.to_container(section) if isinstance(section, DictConfig) else section
        for key in WATCHED_SECTIONS
        for section in (OmegaConf.select(config, key, default=None),)
    }


class EarlyAgentLoopWorker(getattr(AgentLoopWorkerTQ, "__ray_actor_class__", AgentLoopWorkerTQ)):
    """verl's TransferQueue agent-loop worker that may be constructed before the servers exist (``llm_client``
    None) and bound later (:meth:`bind`)."""

    def __init__(
        self,
        config: DictConfig,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: list | None = None,
    ) -> None:
        self.started_at = time.time()
        super().__init__(
            config, UnboundClient() if llm_client is None else llm_client, teacher_client, reward_loop_worker_handles
        )
        self.ready_at = time.time()

    def bind(
        self,
        config: DictConfig,
        llm_client: Any,
        teacher_client: Any = None,
        reward_loop_worker_handles: list | None = None,
    ) -> dict[str, Any]:
        """Take the servers' client and the reward workers' handles (and the final config); the constructor's state
        is rebuilt only if a section it read (:data:`WATCHED_SECTIONS`) changed since the start (``changed`` names
        them)."""
        before, after = _sections(self.config), _sections(config)
        changed = [key for key in WATCHED_SECTIONS if before[key] != after[key]]
        rebuilt = bool(changed)
        if rebuilt:
            AgentLoopWorker.__init__(self, config, llm_client, teacher_client, reward_loop_worker_handles)
        else:
            self.config = config
            self.llm_client = llm_client
            self.teacher_client = teacher_client
            self.reward_loop_worker_handles = reward_loop_worker_handles
            if self.rollout_config.trace.get("token2text", False):
                llm_client.tokenizer = self.tokenizer  # what verl's constructor does for traces
        return {"started_at": self.started_at, "ready_at": self.ready_at, "rebuilt": rebuilt, "changed": changed}


class EarlyAgentLoopManager(AgentLoopManagerTQ):
    """verl's TransferQueue agent-loop manager over the workers the trainer started early (:func:`start`); without
    them (the early start off or refused) it creates its own, bound, as verl does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = worker_class()

    @classmethod
    @auto_await
    async def create(cls, *args: Any, **kwargs: Any) -> EarlyAgentLoopManager:
        instance = cls(*args, **kwargs)
        await instance.bind_workers()
        return instance

    async def bind_workers(self) -> None:
        handles = (self.llm_client, self.teacher_client, self.reward_loop_worker_handles)
        started = take()
        n = int(self.rollout_config.agent.num_workers)
        if started is None or len(started.workers) != n:
            for worker in started.workers if started is not None else ():
                ray.kill(worker)
            self.agent_loop_workers = create_workers(self.config, self.agent_loop_workers_class, handles)
            return
        self.agent_loop_workers = started.workers
        t0 = time.time()
        infos = await asyncio.gather(*[w.bind.remote(self.config, *handles) for w in self.agent_loop_workers])
        waited = time.time() - t0
        ready = max(float(i["ready_at"]) for i in infos)
        rebuilt = sum(bool(i["rebuilt"]) for i in infos)
        changed = sorted({key for i in infos for key in i.get("changed", ())})
        print(
            f"[populora] agent-loop workers: {n} started with the trainer's set-up, ready after "
            f"{ready - started.at:.0f} s, {max(0.0, t0 - ready):.0f} s before the servers' hand-off; bound in "
            f"{waited:.1f} s" + (f" ({rebuilt} rebuilt: {', '.join(changed)} changed)" if rebuilt else ""),
            flush=True,
        )
