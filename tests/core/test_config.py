"""The populora.* config schema: defaults valid, every mistake fails with one line naming the key."""

import pytest

from populora_verl.config import ConfigError, PopuLoRAConfig, load_config, to_dict


def test_defaults_are_valid_and_round_trip():
    cfg = load_config(None)
    assert isinstance(cfg, PopuLoRAConfig)
    assert cfg.population.num_adapters == 8
    again = load_config(to_dict(cfg))
    assert to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize(
    "override, key",
    [
        ({"pbt": {"cull_fraction": 1.5}}, "populora.pbt.cull_fraction"),
        ({"pbt": {"cull_fraction": 0}}, "populora.pbt.cull_fraction"),
        ({"pbt": {"interval_steps": 0}}, "populora.pbt.interval_steps"),
        ({"pbt": {"crossover_rate": -0.1}}, "populora.pbt.crossover_rate"),
        ({"pbt": {"bogus": 1}}, "populora.pbt.bogus"),
        ({"bogus_section": {}}, "populora.bogus_section"),
        ({"population": {"num_teachers": 0}}, "populora.population.num_teachers"),
        ({"population": {"mode": "league"}}, "populora.population.mode"),
        ({"matchmaking": {"outcome": "coin"}}, "populora.matchmaking.outcome"),
        ({"tasks": {"types": ["code_x"]}}, "populora.tasks.types"),
        ({"tasks": {"probabilities": [1.0]}}, "populora.tasks.probabilities"),
        ({"executor": {"timeout_s": "ten"}}, "populora.executor.timeout_s"),
        ({"executor": {"backend": "sandbox_fusion"}}, "populora.executor.sandbox_fusion_url"),
        ({"rewards": {"teacher": "other"}}, "populora.rewards.teacher"),
        ({"rollout": {"student_n": 0}}, "populora.rollout.student_n"),
        ({"rollout": {"max_loras": 3}}, "populora.rollout.max_loras"),
        ({"diagnostics": {"descriptors": ["ast_depth", "halstead"]}}, "populora.diagnostics.descriptors"),
        ({"diagnostics": {"descriptors": ["loc"], "descriptor_max": {"loc": 0}}}, "populora.diagnostics.descriptor_max.loc"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(override)
    msg = str(err.value)
    assert msg.startswith(key + ":"), msg
    assert "\n" not in msg


def test_single_agent_disables_evolution():
    cfg = load_config({"population": {"mode": "single_agent"}})
    assert cfg.population.num_adapters == 1
    assert cfg.pbt.enabled is False


def test_omegaconf_input():
    from omegaconf import OmegaConf

    cfg = load_config(OmegaConf.create({"pbt": {"interval_steps": 3}, "rollout": {"student_n": 2}}))
    assert cfg.pbt.interval_steps == 3 and cfg.rollout.student_n == 2
