"""The agent-loop workers and the request load balancer start with the trainer's set-up, before the vLLM servers are
up; the balancer takes the servers and replaces verl's, and the workers are bound to them afterwards
(populora_verl.rollout.early_agent_loop). Fake worker classes, a fake balancer and a fake verl ``init`` record an
event log; no Ray cluster, no GPU (tests/trainer/test_trainer_tq.py runs the balancer on a real Ray cluster)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from populora_verl.rollout import early_agent_loop as early

SERVERS_UP = "servers up"
NODE = "ab" * 28  # a Ray node id (hex)


def _config(**trainer):
    trainer.setdefault("populora_early_agent_loop", True)  # as the recipes set it; None: the key left out
    if trainer["populora_early_agent_loop"] is None:
        del trainer["populora_early_agent_loop"]
    return OmegaConf.create(
        {
            "trainer": dict(trainer),
            "actor_rollout_ref": {
                "rollout": {"agent": {"num_workers": 2}, "trace": {}},
                "model": {"path": "/m"},
                "actor": {"optim": {"total_training_steps": 0}},
            },
            "data": {"max_prompt_length": 8},
            "reward": {},
        }
    )


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeHandle:
    """An actor handle: ``bind.remote`` is awaitable, as a Ray ObjectRef is."""

    def __init__(self, events, args):
        self.events, self.bound = events, (args or None)
        self.bind = _Remote(self._bind)

    async def _bind(self, config, *handles):
        self.events.append("bind")
        self.bound = handles
        return {"started_at": 1.0, "ready_at": 2.0, "rebuilt": False}


class FakeWorkerClass:
    """``ray.remote(EarlyAgentLoopWorker)`` as the module uses it: ``options(...).remote(config, *args)``."""

    def __init__(self, events):
        self.events, self.created, self.options_seen = events, [], []

    def options(self, **options):
        self.options_seen.append(options)
        return self

    def remote(self, config, *args):
        self.events.append("worker created" if not args else "worker created bound")
        handle = FakeHandle(self.events, args)
        self.created.append(handle)
        return handle


class FakeBalancer:
    """verl's request load balancer as an actor handle: ``add_servers.remote`` returns what ``ray.get`` (patched to
    the identity) reads."""

    def __init__(self, events, name, fail=None):
        self.events, self.name, self.fail, self.servers = events, name, fail, {}
        self.add_servers = _Remote(self._add)

    def _add(self, servers):
        if self.fail is not None:
            raise self.fail()
        self.events.append(f"servers added to {self.name}")
        self.servers.update(servers)


class FakeServerManager:
    """verl's ``LLMServerManager`` after ``create``: its servers up and its own balancer."""

    def __init__(self, events):
        self.server_addresses, self.server_handles = ["10.0.0.1:8000"], ["server0"]
        self.global_load_balancer = FakeBalancer(events, "verl's balancer")


@pytest.fixture
def fakes(monkeypatch):
    """The trainer with verl's ``init`` replaced by the servers' start, the workers and the balancer by fakes; the
    event log (``ray.kill`` and ``ray.get`` record into it and pass values through)."""
    from populora_verl.trainer import trainer as tr

    events: list[str] = []
    workers = FakeWorkerClass(events)
    monkeypatch.setattr(early, "worker_class", lambda: workers)
    monkeypatch.setattr(early, "_node_ids", lambda: [NODE])
    monkeypatch.setattr(early, "_STARTED", None)

    def start_balancer(config):
        events.append("balancer created")
        return FakeBalancer(events, "the early balancer")

    monkeypatch.setattr(early, "start_load_balancer", start_balancer)
    monkeypatch.setattr(early.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(early.ray, "kill", lambda h: events.append(f"killed {getattr(h, 'name', 'a worker')}"))

    def verl_init(self):  # worker groups, then the vLLM servers and verl's balancer: up when this returns
        events.extend(["worker groups", "servers starting", SERVERS_UP])
        self.llm_server_manager = FakeServerManager(events)

    monkeypatch.setattr(tr.PPOTrainerSync, "init", verl_init)
    return tr.PopuLoRATrainer, workers, events


def _task_runner(trainer_cls, config, trainer_out=None):
    """verl's TaskRunnerV1.run: trainer.init(), then the manager named by the config, with the servers' client (the
    trainer's ``llm_server_manager``'s balancer, as verl's ``get_client`` takes it)."""
    t = object.__new__(trainer_cls)
    t.config = config
    t.init()
    if trainer_out is not None:
        trainer_out.append(t)
    assert OmegaConf.select(config, early.MANAGER_KEY) == early.MANAGER_FQN
    client = ("llm-client", t.llm_server_manager.global_load_balancer.name)
    return early.EarlyAgentLoopManager.create(
        config=config, llm_client=client, teacher_client=None, reward_loop_worker_handles=["reward0"]
    )


CLIENT = ("llm-client", "the early balancer")


def test_workers_start_before_the_servers_are_up_and_are_bound_after(fakes):
    trainer_cls, workers, events = fakes
    config = _config()
    assert early.configure(config)  # the trainer's constructor
    trainers = []
    manager = _task_runner(trainer_cls, config, trainers)
    assert events == (
        ["worker created"] * 2
        + ["balancer created", "worker groups", "servers starting", SERVERS_UP]
        + ["servers added to the early balancer", "killed verl's balancer"]
        + ["bind"] * 2
    )
    assert manager.agent_loop_workers == workers.created  # the early workers, none created at the hand-off
    assert all(w.bound == (CLIENT, None, ["reward0"]) for w in workers.created)
    assert [o["scheduling_strategy"].node_id for o in workers.options_seen] == [NODE, NODE]
    assert trainers[0].llm_server_manager.global_load_balancer.servers == {"10.0.0.1:8000": "server0"}
    assert early.take() is None  # taken once


@pytest.mark.parametrize("failure", ["RayActorError", "GetTimeoutError"])  # died; never came up in time
def test_an_early_balancer_that_failed_leaves_verls_in_place(failure, fakes, monkeypatch, capsys):
    import ray.exceptions

    trainer_cls, workers, events = fakes

    def failing(config):
        events.append("balancer created")
        return FakeBalancer(events, "the early balancer", fail=getattr(ray.exceptions, failure))

    monkeypatch.setattr(early, "start_load_balancer", failing)
    config = _config()
    early.configure(config)
    manager = _task_runner(trainer_cls, config)
    assert "killed the early balancer" in events and "killed verl's balancer" not in events
    assert all(w.bound == (("llm-client", "verl's balancer"), None, ["reward0"]) for w in manager.agent_loop_workers)
    assert "verl's is used" in capsys.readouterr().out


class FakeBalancerClass:
    def __init__(self):
        self.made = []

    def remote(self, **kwargs):
        self.made.append(kwargs)
        return "balancer"


def test_a_users_router_keeps_verls_balancer(monkeypatch):
    cls = FakeBalancerClass()
    monkeypatch.setattr(early, "balancer_class", lambda: cls)
    config = _config()
    config.actor_rollout_ref.rollout.name = "vllm"
    assert early.start_load_balancer(config) == "balancer"
    assert cls.made == [{"servers": {}, "full_determinism": False, "backend": ("vllm", False)}]
    OmegaConf.update(config, "actor_rollout_ref.rollout.router_config_path", "my_router.yaml", force_add=True)
    assert early.start_load_balancer(config) is None and len(cls.made) == 1


def test_the_early_balancer_imports_the_rollout_backend_and_routes_as_verls(monkeypatch, caplog):
    """Its constructor runs the backend's replica loader (what rebuilding the servers' handles imports); a loader
    that fails is only noted, and routing is verl's own."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    loaded = []
    monkeypatch.setitem(RolloutReplicaRegistry._registry, "test_backend", lambda: loaded.append(1) or object)
    balancer = early.EarlyRequestLoadBalancer({}, backend=("test_backend", False))
    assert loaded == [1] and "not imported early" not in caplog.text
    balancer.add_servers({"a:1": "server-a"})
    assert balancer.acquire_server("r0") == ("a:1", "server-a")

    def broken():
        raise ImportError("no module named the_engine")

    monkeypatch.setitem(RolloutReplicaRegistry._registry, "broken_backend", broken)
    balancer = early.EarlyRequestLoadBalancer({"b:1": "server-b"}, backend=("broken_backend", False))
    assert "broken_backend not imported early" in caplog.text and "the_engine" in caplog.text
    assert balancer.acquire_server("r0") == ("b:1", "server-b")


def test_verls_order_when_the_early_start_is_off(fakes):
    """The contrast that the test above rules out: workers created only after the servers are up."""
    trainer_cls, workers, events = fakes
    config = _config(populora_early_agent_loop=False)
    assert not early.configure(config)
    OmegaConf.update(config, early.MANAGER_KEY, early.MANAGER_FQN, force_add=True)  # the class set by hand
    manager = _task_runner(trainer_cls, config)
    assert events == ["worker groups", "servers starting", SERVERS_UP] + ["worker created bound"] * 2
    assert manager.agent_loop_workers == workers.created
    assert all(w.bound == (("llm-client", "verl's balancer"), None, ["reward0"]) for w in workers.created)


def test_configure_leaves_a_users_manager_and_distillation_alone(capsys):
    config = _config()
    OmegaConf.update(config, early.MANAGER_KEY, "my.Manager", force_add=True)
    assert not early.configure(config)
    assert OmegaConf.select(config, early.MANAGER_KEY) == "my.Manager"
    assert "verl's point" in capsys.readouterr().out
    config = _config()
    OmegaConf.update(config, "distillation", {"enabled": True}, force_add=True)
    assert not early.configure(config)
    config.actor_rollout_ref.rollout.router_config_path = "my_router.yaml"  # and the user's router: verl's balancer
    assert not early.start(config, worker_cls=object(), node_ids=[])  # nothing named: nothing started


def test_a_worker_count_changed_after_the_start_gets_fresh_bound_workers(fakes, monkeypatch):
    _, workers, events = fakes
    config = _config()
    early.configure(config)
    assert early.start(config)
    killed = []
    monkeypatch.setattr(early.ray, "kill", killed.append)
    OmegaConf.update(config, "actor_rollout_ref.rollout.agent.num_workers", 3)
    manager = early.EarlyAgentLoopManager.create(config=config, llm_client="c", teacher_client=None)
    assert killed == workers.created[:2]
    assert manager.agent_loop_workers == workers.created[2:] and len(manager.agent_loop_workers) == 3
    assert events[3:] == ["worker created bound"] * 3


def _bare_worker(config):
    w = object.__new__(early.EarlyAgentLoopWorker)
    w.config, w.rollout_config, w.tokenizer = config, OmegaConf.create({"trace": {"token2text": True}}), "tok"
    w.started_at, w.ready_at = 1.0, 2.0
    return w


def test_bind_keeps_the_state_unless_a_watched_section_changed(monkeypatch):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    rebuilt = []
    monkeypatch.setattr(AgentLoopWorker, "__init__", lambda self, *a: rebuilt.append(a))

    class Client:
        pass

    config = _config()
    w = _bare_worker(config)
    later = _config()
    OmegaConf.update(later, "actor_rollout_ref.actor.optim.total_training_steps", 100)  # not read by the worker
    # verl's resource-pool set-up fills these in after the early start (seen on a GPU); the constructor reads no reward
    OmegaConf.update(later, "reward.reward_model", {"nnodes": 1, "n_gpus_per_node": 1}, force_add=True)
    client = Client()
    info = w.bind(later, client, None, ["r"])
    assert info == {"started_at": 1.0, "ready_at": 2.0, "rebuilt": False, "changed": []} and not rebuilt
    assert (w.config, w.llm_client, w.reward_loop_worker_handles, client.tokenizer) == (later, client, ["r"], "tok")

    changed = _config()
    OmegaConf.update(changed, "actor_rollout_ref.rollout.agent.num_workers", 4)
    info = w.bind(changed, client, None, ["r"])
    assert info["rebuilt"] and info["changed"] == ["actor_rollout_ref.rollout"]  # named in the hand-off line
    assert rebuilt == [(changed, client, None, ["r"])]


def test_a_worker_started_unbound_holds_a_client_that_refuses_use(monkeypatch):
    base = early.EarlyAgentLoopWorker.__mro__[1]
    seen = []
    monkeypatch.setattr(base, "__init__", lambda self, config, client, *rest: seen.append(client))
    w = early.EarlyAgentLoopWorker(_config())
    assert isinstance(seen[0], early.UnboundClient) and w.ready_at >= w.started_at
    seen[0].tokenizer = "tok"  # verl's constructor may set this much
    with pytest.raises(AttributeError, match="before its LLM client was bound"):
        seen[0].generate  # noqa: B018


def test_the_early_start_is_off_unless_asked_for():
    """A config without the key (one not built on the recipes) keeps verl's order: the manager key stays verl's."""
    config = _config(populora_early_agent_loop=None)
    assert not early.configure(config)
    assert OmegaConf.select(config, early.MANAGER_KEY, default=None) is None


def test_the_recipes_start_the_client_side_early():
    from _shared import compose_recipe

    assert OmegaConf.select(compose_recipe("qwen1.5b_1gpu_2t2s"), early.EARLY_KEY) is True


def test_a_trainer_with_the_early_start_off_adopts_nothing_an_earlier_one_started(fakes):
    trainer_cls, workers, events = fakes
    config = _config()
    assert early.start(config)  # an earlier trainer in this process, its balancer never adopted
    off = _config(populora_early_agent_loop=False)
    assert not early.start(off)
    assert not early.adopt_load_balancer(FakeServerManager(events)) and early.take() is None
    assert events[-1] == "killed the early balancer"  # the earlier trainer's, ended
