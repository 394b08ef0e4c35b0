"""Start-up checks of the resident adapter layout: the recipes accept it, and each verl key it relies on is
refused in one line naming the key."""

from __future__ import annotations

import pytest

from populora_verl.config import ConfigError, load_config
from populora_verl.trainer import verl_config

from _shared import compose_recipe

RESIDENT = "populora.population.adapter_layout=resident"


@pytest.mark.parametrize("name", ["4t4s", "azr_single_agent", "qwen1.5b_1gpu_2t2s"])
def test_recipes_pass_with_resident_adapters(name):
    cfg = compose_recipe(name, [RESIDENT, "actor_rollout_ref.model.path=/m"])
    pcfg = load_config(cfg.populora)
    assert pcfg.population.adapter_layout == "resident"
    verl_config.validate_verl_config(cfg, pcfg)


BAD = [
    ("actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.model.use_remove_padding"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=linear", "actor_rollout_ref.actor.optim.lr_scheduler_type"),
]


@pytest.mark.parametrize("override,key", BAD, ids=[k for _, k in BAD])
def test_what_resident_adapters_rely_on_fails_in_one_line(override, key):
    cfg = compose_recipe("qwen1.5b_1gpu_2t2s", ["actor_rollout_ref.model.path=/m", RESIDENT, override])
    with pytest.raises(ConfigError) as e:
        verl_config.validate_verl_config(cfg, load_config(cfg.populora))
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg
    assert msg.endswith("(or set populora.population.adapter_layout=bank)")
    # the bank layout does not depend on it (the optimizer offload and scheduler keys stay verl's business there)
    if key.endswith(("optimizer_offload", "lr_scheduler_type")):
        bank = compose_recipe("qwen1.5b_1gpu_2t2s", ["actor_rollout_ref.model.path=/m", override,
                                                     "populora.population.adapter_layout=bank"])
        verl_config.validate_verl_config(bank, load_config(bank.populora))


def test_an_unknown_layout_names_the_key():
    with pytest.raises(ConfigError, match=r"^populora\.population\.adapter_layout: must be one of"):
        load_config({"population": {"adapter_layout": "stacked"}})


def test_the_layout_line_says_where_the_adapters_live():
    for layout, words in (("bank", "every adapter sharded over 1"),
                          ("resident", "every adapter resident and replicated on each rank")):
        cfg = compose_recipe("qwen1.5b_1gpu_2t2s", ["actor_rollout_ref.model.path=/m",
                                                    f"populora.population.adapter_layout={layout}"])
        assert words in verl_config.parallel_layout(cfg, load_config(cfg.populora)).describe()


def test_resident_is_the_default_and_the_padded_recipes_keep_the_bank():
    assert load_config({}).population.adapter_layout == "resident"
    for name, layout in (("4t4s", "resident"), ("qwen1.5b_1gpu_2t2s", "resident"), ("azr_single_agent", "resident"),
                         ("smoke_0.5b", "bank"), ("qwen1.5b_4gpu_4t4s", "bank")):
        cfg = compose_recipe(name, ["actor_rollout_ref.model.path=/m"])
        pcfg = load_config(cfg.populora)
        assert pcfg.population.adapter_layout == layout, name
        verl_config.validate_verl_config(cfg, pcfg)  # each recipe as shipped passes its own layout's checks


def test_resident_runs_name_the_resident_engine_where_verl_reads_engine_class(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from populora_verl import verl_compat
    from populora_verl.trainer.trainer import ENGINE_CLASS_KEY, use_resident_engine
    from populora_verl.workers.resident_engine import RESIDENT_ENGINE_FQN

    def cfg(*overrides):
        return compose_recipe("qwen1.5b_1gpu_2t2s", ["actor_rollout_ref.model.path=/m", RESIDENT, *overrides])

    def engine_class(c):
        return OmegaConf.select(c, ENGINE_CLASS_KEY, default=None)

    if not verl_compat.engine_class_from_config():  # verl 0.9.1: nothing is set, the worker swaps the class
        c = cfg()
        assert use_resident_engine(c, ["resident"]) is False and engine_class(c) is None
        monkeypatch.setattr(verl_compat, "engine_class_from_config", lambda: True)
    c = cfg()
    assert use_resident_engine(c, ["resident"]) is True and engine_class(c) == RESIDENT_ENGINE_FQN
    for layouts in (["bank"], ["resident", "bank"]):  # a bank population anywhere in the run keeps verl's engine
        c = cfg()
        assert use_resident_engine(c, layouts) is False and engine_class(c) is None

    # a user's own engine is kept when it extends the resident one, refused in one line otherwise
    (tmp_path / "my_resident.py").write_text(
        "from populora_verl.workers.resident_engine import ResidentFSDPEngineWithLMHead\n"
        "class Mine(ResidentFSDPEngineWithLMHead):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    c = cfg()
    OmegaConf.update(c, ENGINE_CLASS_KEY, "my_resident.Mine", force_add=True)
    assert use_resident_engine(c, ["resident"]) is True and engine_class(c) == "my_resident.Mine"
    plain = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    OmegaConf.update(c, ENGINE_CLASS_KEY, plain, force_add=True)
    with pytest.raises(ConfigError) as e:
        use_resident_engine(c, ["resident"])
    msg = str(e.value)
    assert msg.startswith(ENGINE_CLASS_KEY + ":") and plain in msg and "\n" not in msg
