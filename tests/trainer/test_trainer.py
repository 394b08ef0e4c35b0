"""The verl trainer ``populora``: pure conversions, start-up validation and trainer wiring without GPUs."""

import json

import pytest
import torch

pytest.importorskip("transfer_queue")

from populora_verl.config import ConfigError, load_config  # noqa: E402
from populora_verl.step import GenRequest, Sample  # noqa: E402
from populora_verl.trainer import convert, verl_config  # noqa: E402

from _shared import compose_recipe  # noqa: E402


LORA = {"t0": {"slot": 0, "lora_int_id": 1000, "lora_name": "0@v0"},
        "s0": {"slot": 1, "lora_int_id": 1001, "lora_name": "1@v0"}}


class _Task:
    def to_json(self):
        return '{"type": "code_o"}'


# --- conversions -------------------------------------------------------------------------------------------------


def test_requests_to_rows_carry_routing_and_reward_fields():
    reqs = [GenRequest("t0", "teacher", "code_i", "User: hi\nAssistant: <think>", 1, {"program": None}),
            GenRequest("s0", "student", "code_o", [{"role": "user", "content": "solve"}], 4, {"task": _Task()})]
    rows = convert.requests_to_rows(reqs, LORA, step=3, start_index=10)
    assert [r["index"] for r in rows] == [10, 11]
    assert [r["__rollout_n__"] for r in rows] == [1, 4]
    assert all("_" not in r["uid"] and "-" not in r["uid"] for r in rows)
    assert rows[0]["raw_prompt"] == [{"role": "user", "content": "User: hi\nAssistant: <think>"}]
    assert rows[0]["agent_name"] == "populora_agent"
    p0, p1 = rows[0]["populora"], rows[1]["populora"]
    assert (p0["role"], p0["adapter"], p0["lora_int_id"], p0["slot"], p0["step"]) == ("propose", "t0", 1000, 0, 3)
    assert "task" not in p0
    assert (p1["role"], p1["lora_name"], p1["task"]) == ("solve", "1@v0", '{"type": "code_o"}')
    # The agent loop and the reward manager accept what we build.
    from populora_verl.reward.manager import populora_info
    from populora_verl.rollout.lora_registry import lora_spec_from_prompt

    assert lora_spec_from_prompt(p1) == {"lora_int_id": 1001, "lora_name": "1@v0"}
    assert populora_info(p0)["role"] == "propose"
    # The step scores every row; the reward manager must defer instead of executing each program a second time.
    assert populora_info(p0)["deferred"] and p1["scored_by"] == p0["scored_by"] == "population_step"
    with pytest.raises(KeyError, match="no LoRA id"):
        convert.requests_to_rows([GenRequest("zz", "teacher", "code_i", "x", 1)], LORA, step=0)


def test_rows_to_tensordict_is_a_verl_prompt_batch():
    from tensordict import NonTensorData

    reqs = [GenRequest("t0", "teacher", "code_i", "a", 2), GenRequest("s0", "teacher", "code_i", "b", 3)]
    td = convert.rows_to_tensordict(convert.requests_to_rows(reqs, LORA, step=5), step=5)
    assert len(td) == 2
    assert td["__rollout_n__"].tolist() == [2, 3]
    assert isinstance(td.get("global_steps"), NonTensorData) and td["global_steps"] == 5
    assert td[1]["populora"]["adapter"] == "s0"
    assert list(td[0]["raw_prompt"]) == [{"role": "user", "content": "a"}]


def test_build_gen_responses_orders_sessions_and_fills_failures():
    reqs = [GenRequest("t0", "teacher", "code_i", "p", 3), GenRequest("s0", "student", "code_o", "q", 1)]
    uids = ["aa", "bb"]
    keys = ["aa_2_0", "aa_0_0", "bb_0_0", "bb_0_1"]  # aa session 1 failed; bb session 0 has two outputs
    texts = {k: f"text-{k}" for k in keys}
    lengths = {k: 5 for k in keys}
    out, missing = convert.build_gen_responses(reqs, uids, keys, texts, lengths)
    assert missing == 1
    assert out[0].texts == ["text-aa_0_0", "", "text-aa_2_0"]
    assert out[0].extra == ["aa_0_0", None, "aa_2_0"]
    assert out[0].lengths == [5, 1, 5]
    assert out[1].extra == ["bb_0_1"]  # the last output of a session carries the answer
    with pytest.raises(ValueError, match="unknown prompt groups"):
        convert.build_gen_responses(reqs, uids, keys + ["cc_0_0"], {**texts, "cc_0_0": ""}, {**lengths, "cc_0_0": 1})
    with pytest.raises(ValueError, match="trajectory key"):
        convert.split_key("nounderscore")


def _sample(adapter, key, reward, adv):
    return Sample(adapter, "student", "code_o", "p", "r", reward, advantage=adv, length=3, extra=key)


def test_signal_rows_reward_on_last_token_advantage_broadcast():
    masks = {"k1": torch.tensor([1, 1, 1, 0]), "k2": torch.tensor([1, 1])}
    sig = convert.signal_rows([_sample("s0", "k1", 1.0, 0.5), _sample("s0", "k2", -0.5, -1.25),
                               _sample("s0", None, 9.0, 9.0)], masks)
    assert set(sig) == {"k1", "k2"}
    assert sig["k1"]["rm_scores"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert sig["k1"]["advantages"].tolist() == [0.5, 0.5, 0.5, 0.0]
    assert sig["k2"]["returns"].tolist() == [-0.5, -0.5]
    assert sig["k2"]["rm_scores"].sum().item() == -0.5
    with pytest.raises(ValueError, match="share"):
        convert.signal_rows([_sample("s0", "k1", 1, 1), _sample("s0", "k1", 1, 1)], masks)


def test_partition_keys_per_slot_sorted_and_skips_untrainable():
    samples = [_sample("s0", "b_0_0", 0, 0), _sample("t0", "a_0_0", 0, 0), _sample("s0", None, 0, 0),
               _sample("s0", "c_0_0", 0, 0)]
    parts = convert.partition_keys(samples, {"t0": 0, "s0": 1})
    assert list(parts) == [0, 1]
    assert parts == {0: ["a_0_0"], 1: ["b_0_0", "c_0_0"]}


def test_metric_helpers_and_checksums():
    assert convert.prefix_metrics({"actor/pg_loss": 1.0}, "populora/t0/") == {"populora/t0/actor/pg_loss": 1.0}
    assert convert.mean_over_prefixes({"t0": {"a": 1.0, "x": "s"}, "s0": {"a": 3.0}}) == {"a": 2.0}
    a = {"m.lora_A.weight": torch.ones(2, 3), "m.lora_B.weight": torch.zeros(3, 2)}
    b = {k: v.clone() for k, v in a.items()}
    assert convert.state_checksum(a) == convert.state_checksum(b)
    b["m.lora_B.weight"][0, 0] = 1e-3
    assert convert.state_checksum(a) != convert.state_checksum(b)


# --- start-up validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smoke_0.5b", "1t1s", "2t2s", "4t4s", "8t8s", "azr_single_agent"])
def test_recipes_pass_verl_validation(name):
    cfg = compose_recipe(name, ["actor_rollout_ref.model.path=/m"] if name == "smoke_0.5b" else [])
    verl_config.validate_verl_config(cfg, load_config(cfg.populora))


BAD = [
    ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy"),
    ("actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora_rank"),
    ("actor_rollout_ref.model.lora_rank=1024", "actor_rollout_ref.model.lora_rank"),
    ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "actor_rollout_ref.rollout.checkpoint_engine.backend"),
    ("actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.rollout.mode"),
    ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.use_kl_loss"),
    ("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward"),
    ("critic.enable=true", "critic.enable"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras=3", "actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras=4",
     "actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras"),
    ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable"),
    ("trainer.val_before_train=true", "trainer.val_before_train"),
    ("trainer.total_training_steps=null", "trainer.total_training_steps"),
    ("populora.rollout.max_loras=16", "populora.rollout.max_loras"),
    # Keys the trainer overrides or verl never reads: a value that would be ignored fails at start-up.
    ("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("populora.rollout.max_new_tokens=100", "populora.rollout.max_new_tokens"),
    ("populora.rollout.temperature=0.7", "populora.rollout.temperature"),
    ("++trainer.populora_poll_interval_s=0", "trainer.populora_poll_interval_s"),
    ("++trainer.populora_poll_interval_s=fast", "trainer.populora_poll_interval_s"),
]


def test_populora_rollout_keys_equal_to_verl_pass():
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", "populora.rollout.max_new_tokens=512",
                                        "populora.rollout.temperature=1.0"])
    verl_config.validate_verl_config(cfg, load_config(cfg.populora))


@pytest.mark.parametrize("override,key", BAD, ids=[k for _, k in BAD])
def test_bad_verl_key_fails_with_one_line_naming_it(override, key):
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", override])
    with pytest.raises(ConfigError) as e:
        verl_config.validate_verl_config(cfg, load_config(cfg.populora))
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_removed_key_still_given_fails_with_one_line_naming_it(value):
    given = f"++trainer.populora_engine_preload={value}"  # true or false: the key itself is gone
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", given])
    with pytest.raises(ConfigError) as e:
        verl_config.validate_verl_config(cfg, load_config(cfg.populora))
    assert str(e.value) == (
        "trainer.populora_engine_preload: removed (the forked engine core could not use CUDA on the GPU stack; "
        "vLLM spawns it)"
    )


# --- the trainer class without GPUs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_cls():
    from populora_verl.trainer import register

    return register()


def test_register_is_idempotent_and_named_populora(trainer_cls):
    import verl  # noqa: F401  (plugin entry point)
    from verl.trainer.ppo.v1 import get_trainer_cls

    from populora_verl.trainer import register
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    assert register() is trainer_cls
    assert get_trainer_cls("populora") is trainer_cls
    assert issubclass(trainer_cls, PPOTrainerSync)


def test_sync_fix_gives_the_sync_replay_buffer(trainer_cls, monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    import populora_verl.plugin as plugin

    monkeypatch.setattr(plugin, "check_registrations", lambda: None)  # the plugin's wiring is tested elsewhere
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m"])
    t = trainer_cls(cfg)
    from populora_verl import verl_compat

    # a verl with PPOTrainer.is_async (patches/0007) keeps the mode's name and reads the class's answer
    assert t.trainer_mode == ("populora" if verl_compat.trainer_declares_async() else "sync")
    assert t.parameter_sync_step == 1 and getattr(t, "is_async", False) is False
    assert type(t.replay_buffer) is ReplayBuffer and not isinstance(t.replay_buffer, ReplayBufferAsync)
    # a verl with the prompt hand-off public (patches/0020) refills through the public hook; verl 0.9.1 through the
    # private name, which the trainer forwards to it
    refill = "add_prompts_to_generate" if verl_compat.has_public_prompt_submission() else "_add_prompts_to_generate"
    assert t.replay_buffer.refill_fn.__func__ is getattr(trainer_cls, refill)
    with pytest.raises(RuntimeError, match="no dataset"):  # the plugin's refill: nothing to resubmit outside a step
        t.replay_buffer.refill_fn(1)
    # verl's buffer would poll every 2 s, keeping each rollout phase up to 2 s past its last trajectory
    assert t.replay_buffer.poll_interval == verl_config.DEFAULT_POLL_INTERVAL_S < 2.0
    slow = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", "++trainer.populora_poll_interval_s=0.5"])
    assert trainer_cls(slow).replay_buffer.poll_interval == 0.5
    assert t.pcfg.population.num_adapters == 4
    # a bad verl key stops the trainer before any worker starts
    bad = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.name:"):
        trainer_cls(bad)


def test_resource_pool_uses_the_populora_worker(bare_trainer):
    from verl.trainer.ppo.utils import Role

    from populora_verl.workers.worker import PopuLoRAActorRolloutRefWorker

    from populora_verl import verl_compat
    from populora_verl.trainer.trainer import use_populora_worker

    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m"])
    # a verl that reads actor_rollout_ref.worker_class (patches/0004) builds the role from the key, which the
    # trainer's __init__ sets; verl 0.9.1 needs the trainer's override
    assert use_populora_worker(cfg) is verl_compat.worker_class_from_config()
    t = bare_trainer(cfg)
    t._init_resource_pool_mgr()
    cls = t.role_worker_mapping[Role.ActorRollout]
    assert cls.__ray_actor_class__ is PopuLoRAActorRolloutRefWorker
    assert t.mapping[Role.ActorRollout] == "global_pool"


def test_null_dataloader_sets_steps_and_checkpoints(bare_trainer):
    from populora_verl import verl_compat

    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", "trainer.total_training_steps=7"])
    t = bare_trainer(cfg, parameter_sync_step=1)
    t._init_dataloader()
    assert t.total_training_steps == 7 and t.steps_per_epoch >= 7
    assert (t.total_training_steps - 1) // t.steps_per_epoch == 0  # fit() never ends an "epoch" early
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps == 7
    if verl_compat.trainer_without_dataset():
        # a verl with PPOTrainer.uses_dataset (patches/0012) builds no loader and keeps no dataloader state
        assert t.uses_dataset is False and t.train_dataloader is None and t.val_dataloader is None
    else:
        state = t.train_dataloader.state_dict()
        t.train_dataloader.load_state_dict(state)
        assert list(t.train_dataloader) == []
    assert t._validate() == {}
    # a verl with the public step stages (patches/0018) calls the public hook, verl 0.9.1 the private one
    multiple = "get_required_batch_multiple" if verl_compat.has_public_step_stages() else "_get_required_batch_multiple"
    assert getattr(t, multiple)(4) == 4


class _FakeWG:
    """Records ONE_TO_ALL RPCs; two ranks, rank 0 returns the data (as the PopuLoRA worker does)."""

    def __init__(self):
        self.calls = []
        self.adapters = {0: {"a.lora_A.weight": torch.ones(2, 2)}, 1: {"a.lora_A.weight": torch.zeros(2, 2)}}

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "populora_get_adapter":
                return [self.adapters[args[0]], None]
            if name == "populora_bank_info":
                return [{"num_slots": 2, "slots": [{"slot": 0, "version": 1, "lora_int_id": 1002, "lora_name": "0@v1"},
                                                   {"slot": 1, "version": 0, "lora_int_id": 1001, "lora_name": "1@v0"}]},
                        None]
            return [None, None]

        return call


def test_lora_table_and_update_actor_use_the_slot_batch(bare_trainer):
    from transfer_queue import KVBatchMeta

    cfg = compose_recipe("1t1s")
    t = bare_trainer(cfg)
    t.pcfg = load_config(cfg.populora)
    from populora_verl.population import Population

    class _Step:
        population = Population.create(t.pcfg)

    t.pop_step = _Step()
    t.actor_rollout_wg = _FakeWG()
    table = t._lora_table()
    slots = {m.id: m.slot for m in t.pop_step.population.members}
    tid = next(m for m in slots if m.startswith("t"))
    assert table[tid]["slot"] == slots[tid]
    assert table[tid]["lora_int_id"] == (1002 if slots[tid] == 0 else 1001)
    assert t._get_adapter(0)["a.lora_A.weight"].sum().item() == 4.0

    captured = {}

    def update_actor(batch):
        captured.update(batch.extra_info)
        return {"metrics": {"pg_loss": [0.5, 1.5], "mfu": [0.1]}}

    t.actor_rollout_wg.update_actor = update_actor
    meta = KVBatchMeta(partition_id="train", keys=["a_0_0", "a_1_0", "b_0_0"], tags=[{}, {}, {}],
                       extra_info={"populora_adapter": 1})
    m = {}
    from populora_verl import verl_compat

    # the slot's whole batch is one mini-batch: through verl's public update and its extra_info hook where verl has
    # them (patches/0018), through the trainer's own update on verl 0.9.1
    (t.update_actor if verl_compat.has_public_step_stages() else t._update_actor)(meta, m)
    assert captured["global_batch_size"] == captured["mini_batch_size"] == 3
    assert captured["epochs"] == cfg.actor_rollout_ref.actor.ppo_epochs and "temperature" in captured
    assert captured["populora_adapter"] == 1
    assert m["actor/pg_loss"] == 1.0 and "perf/mfu/actor" in m


def test_lazy_adapters_fetch_only_what_pbt_reads(trainer_cls):
    from types import SimpleNamespace

    from populora_verl.step.engine import AdapterView
    from populora_verl.trainer.hooks import TrainerEngine

    fetched = []
    engine = TrainerEngine(SimpleNamespace(_get_adapter=lambda s: fetched.append(s) or {"slot": s}))
    lazy = AdapterView(engine, {"t0": 0, "t1": 1, "s0": 2})  # what _evolve hands to PBT
    assert len(lazy) == 3 and set(lazy) == {"t0", "t1", "s0"}
    assert lazy["t1"] == {"slot": 1} and lazy["t1"] == {"slot": 1}
    assert fetched == [1]


def test_per_adapter_partition_of_a_combined_batch():
    from transfer_queue import KVBatchMeta

    keys = ["a_0_0", "b_0_0", "b_1_0", "c_0_0"]
    combined = KVBatchMeta(partition_id="train", keys=keys, tags=[{"seq_len": i} for i in range(4)])
    samples = [_sample("t0", "a_0_0", 0, 0), _sample("s0", "b_0_0", 0, 0), _sample("s0", "b_1_0", 0, 0),
               _sample("t0", "c_0_0", 0, 0)]
    parts = convert.partition_keys(samples, {"t0": 0, "s0": 1})
    subs = {slot: combined.select_keys(k) for slot, k in parts.items()}
    assert subs[0].keys == ["a_0_0", "c_0_0"] and [t["seq_len"] for t in subs[0].tags] == [0, 3]
    assert subs[1].keys == ["b_0_0", "b_1_0"]
    assert sorted(k for s in subs.values() for k in s.keys) == sorted(keys)


def test_metrics_row_is_written_after_evolution(bare_trainer, tmp_path, monkeypatch):
    """metrics.jsonl gets the step's population metrics with evolution's event count (known only at the end of the
    step, once evolution ran)."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", f"trainer.default_local_dir={tmp_path}"])
    t = bare_trainer(cfg)
    t.global_steps, t.timing_raw = 2, {}
    t._step_population_metrics = {"populora/validity/mean": 0.25, "populora/evolution/events": 0.0}
    monkeypatch.setattr(t, "_evolve", lambda: {"populora/evolution/events": 2.0})
    monkeypatch.setattr(PPOTrainerSync, "on_step_end", lambda self: None)  # the weight sync needs vLLM
    metrics = {}
    t._end_step(metrics)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 2, "populora/validity/mean": 0.25, "populora/evolution/events": 2.0}]
    assert metrics["populora/evolution/events"] == 2.0  # verl's own logger gets it in the step's row


def test_the_checkpoint_after_a_step_holds_its_evolved_population(bare_trainer, tmp_path, monkeypatch, capsys):
    """fit() runs step, then its save when due, then on_step_end: evolution ends the step, so the population written
    with verl's checkpoint is the evolved one, and the weight sync after it serves the children; no second save."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from populora_verl import verl_compat
    from populora_verl.step import PopulationStep
    from populora_verl.trainer import resume

    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", f"trainer.default_local_dir={tmp_path}"])
    t = bare_trainer(cfg)
    t.pop_step = PopulationStep(cfg.populora, total_steps=100)
    order = []
    monkeypatch.setattr(t, "_evolve", lambda: order.append("evolve") or {"populora/evolution/events": 1.0})
    monkeypatch.setattr(t, "_save_population", lambda d: order.append(("population", d)))
    hook = verl_compat.has_save_hook()  # with the series, verl's save calls the trainer's hook inside itself

    def verl_save(self):
        order.append("verl save")
        if hook:
            self.on_save_checkpoint(self._step_folder())

    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", verl_save)
    monkeypatch.setattr(PPOTrainerSync, "on_step_end", lambda self: order.append("weight sync"))
    monkeypatch.setattr(resume, "prune_step_folders", lambda root, keep: [])
    t.timing_raw, t.total_training_steps, t.global_steps = {}, 100, 2
    t._end_step({})
    t._save_checkpoint()  # save_freq due at this step
    t.on_step_end()
    folder = t._step_folder()
    saves = ["verl save", ("population", folder)] if hook else [("population", folder), "verl save"]
    assert order == ["evolve", *saves, "weight sync"]
    assert t._saved_step == 2 and f"[populora] step 2: checkpoint {folder}" in capsys.readouterr().out


def test_stop_file_ends_the_run_at_the_first_step_past_the_quiet_window(bare_trainer, tmp_path, monkeypatch):
    """touch <run dir>/STOP: no evolution, a checkpoint and the end of fit() at the first step where no member is
    younger than the final quiet window; before that step the run goes on (and evolves) as usual."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from populora_verl.step import PopulationStep
    from populora_verl.trainer import stop

    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", f"trainer.default_local_dir={tmp_path}"])
    t = bare_trainer(cfg)
    t.pop_step = PopulationStep(cfg.populora, total_steps=100)
    evolved, saved = [], []
    monkeypatch.setattr(t, "_evolve", lambda: evolved.append(t.global_steps) or {"populora/evolution/events": 1.0})
    monkeypatch.setattr(t, "_save_checkpoint", lambda: saved.append(t.global_steps))
    monkeypatch.setattr(PPOTrainerSync, "on_step_end", lambda self: None)  # the weight sync needs vLLM
    t.timing_raw, t.total_training_steps = {}, 100
    window = t.pop_step.population.age_window
    assert window == 2  # smoke recipe: pbt.interval_steps 2, quiet window one interval

    def step_ends():  # what fit() runs after the update when verl itself saves nothing this step
        t._end_step({})
        t.on_step_end()

    t.global_steps = 1
    step_ends()  # no stop file: evolution runs
    assert evolved == [1] and saved == [] and t.total_training_steps == 100

    (tmp_path / "STOP").write_text("")
    t.pop_step.population.members[0].age = window - 1  # a child one step too young
    t.global_steps = 2
    step_ends()
    assert evolved == [1, 2] and saved == [] and t.total_training_steps == 100
    for m in t.pop_step.population.members:
        m.age = window
    t.global_steps = 3
    step_ends()
    assert evolved == [1, 2] and saved == [3] and t.total_training_steps == 3  # fit() leaves its loop after step 3

    # "echo N > STOP": not before step N; garbage in the file means "stop"
    assert stop.read_request(str(tmp_path / "missing")) is None
    (tmp_path / "STOP").write_text("40\n")
    assert stop.read_request(str(tmp_path / "STOP")) == 40
    assert not stop.due(40, 39, 9, 2) and stop.due(40, 40, 9, 2) and not stop.due(0, 40, 1, 2)
    assert stop.due(0, 7, None, None)  # no PBT: any step
    (tmp_path / "STOP").write_text("soon please")
    assert stop.read_request(str(tmp_path / "STOP")) == 0
    assert stop.stop_file(cfg) == str(tmp_path / "STOP")


def test_start_up_timeline_names_each_phase_and_survives_a_missing_start(monkeypatch):
    """The trainer's one-line start-up breakdown: time between consecutive marks, total from the command's start
    (recorded at plugin import, inherited by Ray's processes); without it the line just starts later."""
    from populora_verl.trainer.timeline import START_ENV, Timeline, record_start

    tl = Timeline(start=100.0)
    for name, at in (("ray + task runner", 141.0), ("workers + vLLM", 323.0), ("checkpoint + weight sync", 326.0),
                     ("agent loop", 335.0), ("step 1", 383.0)):
        tl.mark(name, at=at)
    assert tl.line() == ("[populora] start-up: ray + task runner 41 s | workers + vLLM 182 s | checkpoint + weight "
                         "sync 3 s | agent loop 9 s | step 1 48 s | total 283 s")
    monkeypatch.delenv(START_ENV, raising=False)
    record_start()
    import os

    first = os.environ[START_ENV]
    record_start()
    assert os.environ[START_ENV] == first  # the first process to import the plugin keeps its time
    from populora_verl.trainer import timeline

    assert timeline.imported_at() is not None  # this process imported the plugin: the task runner's own mark
    monkeypatch.setenv(START_ENV, "not a number")
    late = Timeline()
    late.mark("a", at=1.0)
    late.mark("b", at=3.0)
    assert late.line() == "[populora] start-up: b 2 s | total 2 s"


def test_the_trainer_splits_ray_from_the_task_runners_own_setup(monkeypatch):
    """In the task runner's process the plugin's import time divides the first phase (Ray, then the task runner's
    set-up) and the trainer module's import time divides the set-up (its imports, then the config and TransferQueue's
    start); an import time before the command's start (not the task runner's process) keeps one phase."""
    from populora_verl.trainer import timeline, trainer as tr

    class Stop(Exception):
        pass

    def base_init(self, config):
        raise Stop  # the marks are set before verl's constructor runs

    monkeypatch.setattr(tr.PPOTrainerSync, "__init__", base_init)
    monkeypatch.setattr(tr, "IMPORTED_AT", 160.0)  # the trainer's module, imported after the plugin
    split = ["start", "ray + task runner", "task runner imports", "config + TransferQueue"]
    for imported, names in ((150.0, split), (50.0, ["start", "ray + task runner"])):
        monkeypatch.setenv(timeline.START_ENV, "100.0")
        monkeypatch.setattr(timeline, "_IMPORTED_AT", imported)
        t = object.__new__(tr.PopuLoRATrainer)
        with pytest.raises(Stop):
            tr.PopuLoRATrainer.__init__(t, None)
        assert [n for n, _ in t._timeline.marks] == names
        if names == split:
            assert [at for _, at in t._timeline.marks[1:3]] == [imported, 160.0]


def test_the_trainer_marks_start_up_phases_once_and_in_order():
    from populora_verl.trainer.timeline import Timeline
    from populora_verl.trainer.trainer import PopuLoRATrainer

    t = object.__new__(PopuLoRATrainer)
    assert t._timeline is None and t._timeline_done  # built without __init__: no timeline, nothing printed
    t._mark("workers + vLLM")  # a no-op, not an error
    t._timeline, t._timeline_done = Timeline(start=0.0), False
    t._mark("agent loop", after="checkpoint + weight sync")  # out of order: ignored
    t._mark("workers + vLLM")
    t._mark("checkpoint + weight sync")
    t._mark("agent loop", after="checkpoint + weight sync")
    assert [n for n, _ in t._timeline.marks] == ["start", "workers + vLLM", "checkpoint + weight sync", "agent loop"]
    t._timeline_done = True
    t._mark("workers + vLLM")  # a later _load_checkpoint (a population schedule) adds nothing
    assert len(t._timeline.marks) == 4


def test_an_evolution_event_puts_its_phases_into_the_step_timing(bare_trainer, tmp_path, monkeypatch, capsys):
    """The event through the workers' RPC (two CPU ranks, each with its own bank of small stand-in adapters): the
    step's timing_raw, which verl logs as timing_s/<key>, holds the event's total under populora_evolve and each
    phase under populora_evolve/<phase>; one line says how long it took and where the time went."""
    import re
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from populora_verl.bench.evolution_event import make_store
    from populora_verl.bench.operators import ModelShape
    from populora_verl.step import PopulationStep
    from populora_verl.workers.adapter_bank import EVOLUTION_PHASES
    from populora_verl.workers.worker import PopuLoRAActorRolloutRefWorker

    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", f"trainer.default_local_dir={tmp_path}"])
    t = bare_trainer(cfg)
    t.pop_step = PopulationStep(cfg.populora, total_steps=100)
    n = len(t.pop_step.population.members)
    workers = []
    for rank in range(2):
        w = PopuLoRAActorRolloutRefWorker.__new__(PopuLoRAActorRolloutRefWorker)
        w.bank = make_store("bank", ModelShape(layers=2, hidden=16, intermediate=24, kv_out=8), rank=4, num_slots=n)
        w._rank = rank
        workers.append(w)
    t.actor_rollout_wg = SimpleNamespace(populora_apply_plan=lambda entries: [w.populora_apply_plan(entries)
                                                                              for w in workers])
    monkeypatch.setattr(PPOTrainerSync, "on_step_end", lambda self: None)  # the weight sync needs vLLM
    t.timing_raw, t.total_training_steps, t.global_steps = {}, 100, 2
    metrics = {}
    t._end_step(metrics)

    children = len(json.loads((tmp_path / "evolution.jsonl").read_text())["replacements"])
    assert children >= 1 and metrics["populora/evolution/events"] == children
    phases = {p: t.timing_raw[f"populora_evolve/{p}"] for p in EVOLUTION_PHASES}
    assert set(t.timing_raw) == {"populora_evolve", *(f"populora_evolve/{p}" for p in EVOLUTION_PHASES)}
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= t.timing_raw["populora_evolve"]
    line = next(x for x in capsys.readouterr().out.splitlines() if " evolution at step" in x)
    num = r"(\d+\.\d\d)"
    m = re.fullmatch(rf"\[populora\] evolution at step 2: {children} child(?:ren)? in {num} s "
                     rf"\(operator {num}, gather {num}, scatter {num}, optimizer {num}\)", line)
    assert m is not None, line
    for k in range(n):  # every rank made the same children
        a, b = (w.bank.get_adapter_state(k) for w in workers)
        assert all(torch.equal(a[key], b[key]) for key in a)

    t.global_steps = 3  # not due: no phases, no line
    t.timing_raw = {}
    t._end_step({})
    assert set(t.timing_raw) == {"populora_evolve"}
    assert " evolution at step" not in capsys.readouterr().out
