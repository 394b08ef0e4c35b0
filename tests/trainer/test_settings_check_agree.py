"""populora.enable's fill-in table (enable.SETTINGS) and the start-up check (verl_config.validate_verl_config) are
one list: the check reads its required values from SETTINGS at each call, so changing a value there changes what
the check refuses. Hydra compose on CPU: no GPU, no Ray."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("hydra")

from _shared import compose_recipe  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from populora_verl.config import ConfigError, load_config  # noqa: E402
from populora_verl.trainer import enable, verl_config  # noqa: E402
from populora_verl.trainer.enable import SETTINGS, Setting  # noqa: E402

KEYS = [s.key for s in SETTINGS]


def _config(*overrides):
    return compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", *overrides])


def _check(cfg) -> None:
    verl_config.validate_verl_config(cfg, load_config(cfg.populora))


def _refusal(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _other(value):
    """A value that is not ``value`` (of the same kind where that is possible)."""
    return (not value) if isinstance(value, bool) else "not_populora"


def _set(cfg, key, value) -> None:
    OmegaConf.update(cfg, key, value, merge=False, force_add=True)


def _with(monkeypatch, key, **changes) -> Setting:
    """SETTINGS with the setting of ``key`` changed, patched where both enable and the check read it."""
    changed = dataclasses.replace(next(s for s in SETTINGS if s.key == key), **changes)
    monkeypatch.setattr(enable, "SETTINGS", tuple(changed if s.key == key else s for s in SETTINGS))
    return changed


def test_every_required_key_and_value_comes_from_settings():
    required = verl_config.required_settings()
    assert [s.key for s in required] == [k for k in KEYS if k not in verl_config.NOT_CHECKED]
    assert all(r is s for r, s in zip(required, (s for s in SETTINGS if s.key not in verl_config.NOT_CHECKED)))
    # The exceptions name keys of SETTINGS (a renamed key cannot leave a stale exception behind) and say why.
    assert set(verl_config.NOT_CHECKED) <= set(KEYS) and all(verl_config.NOT_CHECKED.values())
    assert set(verl_config.UNSET_MEANS) <= {s.key for s in required}


def test_a_recipe_passes_and_enable_has_nothing_left_to_set():
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m"], hydra_config=True)
    _check(cfg)
    assert enable.apply_populora_settings(cfg, dry_run=True) == []


@pytest.mark.parametrize("setting", verl_config.required_settings(), ids=lambda s: s.key)
def test_each_required_value_is_refused_in_one_line_naming_key_and_value(setting):
    cfg = _config()
    _set(cfg, setting.key, _other(setting.value))
    msg = _refusal(cfg)
    assert msg.startswith(f"{setting.key}: must be {verl_config._expected(setting.value)} ({setting.why}), got "), msg


@pytest.mark.parametrize("key", sorted(verl_config.NOT_CHECKED))
def test_keys_enable_fills_but_the_check_leaves_alone(key):
    cfg = _config()
    _set(cfg, key, "fsdp" if key.endswith(".strategy") else "/some/file.parquet")
    _check(cfg)


def test_changing_a_value_in_settings_changes_what_the_check_refuses(monkeypatch):
    key = "trainer.v1.trainer_mode"
    cfg = _config()
    _check(cfg)
    _with(monkeypatch, key, value="some_other_trainer", why="a test's trainer")
    assert _refusal(cfg) == f"{key}: must be 'some_other_trainer' (a test's trainer), got 'populora'"
    _set(cfg, key, "some_other_trainer")
    _check(cfg)
    # and enable fills in the new value too (over verl's stock 'sync'): one table for both
    fresh = _config(f"{key}=sync")
    assert (key, "some_other_trainer") in enable.apply_populora_settings(fresh, dry_run=True)


def test_a_setting_added_or_removed_in_settings_is_added_to_or_removed_from_the_check(monkeypatch):
    cfg = _config()
    new = Setting("trainer.some_new_switch", True, (None,), "a test's switch")
    monkeypatch.setattr(enable, "SETTINGS", (*SETTINGS, new))
    assert _refusal(cfg) == "trainer.some_new_switch: must be true (a test's switch), got None"
    monkeypatch.setattr(enable, "SETTINGS", tuple(s for s in SETTINGS if s.key != "algorithm.adv_estimator"))
    _set(cfg, "algorithm.adv_estimator", "grpo")
    _check(cfg)


@pytest.mark.parametrize("key", sorted(verl_config.UNSET_MEANS))
def test_a_null_key_passes_only_while_verl_reads_it_as_the_value(key, monkeypatch):
    cfg = _config()
    _set(cfg, key, None)
    _check(cfg)
    # required value changed away from verl's reading of null: null is refused now
    _with(monkeypatch, key, value=_other(verl_config.UNSET_MEANS[key]))
    assert _refusal(cfg).startswith(f"{key}: must be ")


def test_a_null_critic_switch_is_refused():
    cfg = _config()
    _set(cfg, "critic.enable", None)
    assert _refusal(cfg).startswith("critic.enable: must be false (TRR++ needs no critic; null turns one on for gae)")
