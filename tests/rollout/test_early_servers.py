"""vLLM's server actors started with the trainer's set-up (populora_verl.rollout.early_servers), without Ray or
vLLM: the deferred construction, the names and options verl gives its servers, the hand-over and its refusals. The
hand-over through real Ray actors is in tests/trainer/test_trainer_tq.py."""

from __future__ import annotations

import pytest

from populora_verl.rollout import early_servers as es

from _shared import compose_recipe


NODE_A, NODE_B = "a1" * 28, "b2" * 28  # Ray checks a node id's form


class _Server(es.DeferredInit):
    def __init__(self, *args, **kwargs):
        if es.defer(self, kwargs):
            return
        self.built = (args, kwargs)


def test_a_deferred_server_is_built_by_populora_init_with_verls_arguments_once():
    server = _Server(populora_deferred=True)
    assert not hasattr(server, "built")
    server.populora_init("config", replica_rank=1)
    assert server.built == (("config",), {"replica_rank": 1})
    with pytest.raises(RuntimeError, match="constructed already"):
        server.populora_init("again")
    assert _Server("plain").built == (("plain",), {})  # created as verl creates it: built at once
    with pytest.raises(RuntimeError, match="constructed already"):
        _Server("plain").populora_init()


@pytest.mark.parametrize(
    "recipe, overrides, names",
    [
        ("qwen1.5b_1gpu_2t2s", [], ["populora_vllm_server_0_0"]),
        ("qwen1.5b_4gpu_4t4s", [], [f"populora_vllm_server_{r}_0" for r in range(4)]),
        ("qwen1.5b_4gpu_4t4s", ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
         ["populora_vllm_server_0_0", "populora_vllm_server_1_0"]),
        ("qwen1.5b_4gpu_4t4s", ["trainer.nnodes=2"], None),  # several nodes: verl's order
        ("qwen1.5b_1gpu_2t2s", ["actor_rollout_ref.rollout.name=vllm"], None),  # another backend
        ("qwen1.5b_1gpu_2t2s", ["actor_rollout_ref.hybrid_engine=false"], None),
    ],
)
def test_the_names_are_those_verl_gives_its_servers(recipe, overrides, names):
    assert es.server_names(compose_recipe(recipe, overrides)) == names


def test_the_options_are_verls_and_only_the_same_options_match():
    config = compose_recipe("qwen1.5b_1gpu_2t2s")
    opts = es.server_options(config, "populora_vllm_server_0_0", NODE_A)
    assert set(opts) == {"scheduling_strategy", "runtime_env", "name", "max_concurrency"}
    assert opts["max_concurrency"] >= max(1000, int(config.actor_rollout_ref.rollout.max_num_seqs))
    assert (opts["scheduling_strategy"].node_id, opts["scheduling_strategy"].soft) == (NODE_A, False)
    assert es._same(opts, es.server_options(config, "populora_vllm_server_0_0", NODE_A))
    assert not es._same(opts, es.server_options(config, "populora_vllm_server_0_0", NODE_B))
    assert not es._same(opts, es.server_options(config, "populora_vllm_server_1_0", NODE_A))
    assert not es._same(opts, {**opts, "max_concurrency": 7})
    assert not es._same(opts, {**opts, "num_cpus": 1})


class _Handle:
    def __init__(self, name):
        self.name = name


class _ActorClass:
    """A stand-in for a Ray actor class: records what was created with which options."""

    def __init__(self):
        self.created = []

    def options(self, **options):
        cls = self

        class _Opts:
            def remote(self, *args, **kwargs):
                cls.created.append((options, args, kwargs))
                return _Handle(options["name"])

        return _Opts()


def _early(monkeypatch, names, fail=None):
    config = compose_recipe("qwen1.5b_4gpu_4t4s")
    created = _ActorClass()
    monkeypatch.setattr(es, "_ACTIVE", None)
    monkeypatch.setattr("ray.remote", lambda cls: created)
    ended = []
    monkeypatch.setattr(es, "_end", lambda handle, name: ended.append(name))

    def load():
        if fail:
            raise fail
        return _Server

    early = es.EarlyServers(config, load, NODE_A, names)
    early._thread.join()
    return config, early, created, ended


def test_verls_replica_takes_the_waiting_actor_and_builds_it_with_its_arguments(monkeypatch):
    config, early, created, ended = _early(monkeypatch, ["populora_vllm_server_0_0", "populora_vllm_server_1_0"])
    assert [(o["name"], k) for o, _, k in created.created] == [
        ("populora_vllm_server_0_0", {"populora_deferred": True}),
        ("populora_vllm_server_1_0", {"populora_deferred": True}),
    ]
    built = []
    monkeypatch.setattr("ray.get", lambda ref: ref)

    class _InitHandle(_Handle):
        def __init__(self, name):
            super().__init__(name)
            self.populora_init = type("M", (), {"remote": staticmethod(lambda *a, **k: built.append((a, k)))})

    early._actors["populora_vllm_server_0_0"] = (_InitHandle("populora_vllm_server_0_0"),
                                                 early._actors["populora_vllm_server_0_0"][1])
    verls_class = _ActorClass()
    wrapped = es._EarlyServerClass(verls_class, early)
    handle = wrapped.options(**es.server_options(config, "populora_vllm_server_0_0", NODE_A)).remote(
        config="c", replica_rank=0)
    assert handle.name == "populora_vllm_server_0_0" and built == [((), {"config": "c", "replica_rank": 0})]
    assert verls_class.created == []  # no second process for that replica
    # a replica asking with other options gets verl's own actor, after the waiting one is ended
    other = {**es.server_options(config, "populora_vllm_server_1_0", NODE_A), "max_concurrency": 5}
    handle = wrapped.options(**other).remote(config="c", replica_rank=1)
    assert ended == ["populora_vllm_server_1_0"] and [o for o, _, _ in verls_class.created] == [other]
    # a name the trainer did not start (a reward model's server): verl's own
    wrapped.options(**es.server_options(config, "populora_vllm_server_reward_0_0", NODE_A)).remote()
    assert len(verls_class.created) == 2
    assert early.finish().startswith("vLLM server actors: 1 of 2 started with the trainer's set-up and taken")


def test_a_class_that_fails_to_load_leaves_verls_order(monkeypatch):
    config, early, created, ended = _early(monkeypatch, ["populora_vllm_server_0_0"], fail=ImportError("no vllm"))
    assert created.created == []
    assert early.take(es.server_options(config, "populora_vllm_server_0_0", NODE_A)) is None
    assert "not started early (ImportError: no vllm); verl's order" in early.finish()


def test_wrap_changes_nothing_without_early_servers(monkeypatch):
    monkeypatch.setattr(es, "_ACTIVE", None)
    cls = object()
    assert es.wrap(cls) is cls and es.finish() is None


def test_no_actor_is_created_after_a_hand_over_gave_up_waiting(monkeypatch):
    import threading

    release = threading.Event()
    config = compose_recipe("qwen1.5b_1gpu_2t2s")
    created = _ActorClass()
    monkeypatch.setattr("ray.remote", lambda cls: created)
    monkeypatch.setattr(es, "WAIT_S", 0.01)

    def load():  # an import that has not finished when verl asks
        release.wait()
        return _Server

    early = es.EarlyServers(config, load, NODE_A, ["populora_vllm_server_0_0"])
    assert early.take(es.server_options(config, "populora_vllm_server_0_0", NODE_A)) is None  # verl creates its own
    release.set()
    early._thread.join()
    assert created.created == []  # the name stays verl's
    assert early.finish().startswith("vLLM server actors: 0 of 1")
