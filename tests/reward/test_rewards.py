"""Reward levels from RewardsConfig (teacher learnability, student levels)."""

from __future__ import annotations

import pytest

from populora_verl.config import RewardsConfig
from populora_verl.reward import learnability, solve_rate, student_reward, teacher_reward


def test_student_levels_follow_config():
    cfg = RewardsConfig()
    assert [student_reward(s, cfg) for s in ("correct", "wrong", "format_error")] == [1.0, -0.5, -1.0]
    custom = RewardsConfig(correct=2.0, wrong_answer=0.0, format_error=-3.0)
    assert [student_reward(s, custom) for s in ("correct", "wrong", "format_error")] == [2.0, 0.0, -3.0]
    with pytest.raises(ValueError):
        student_reward("valid", cfg)


@pytest.mark.parametrize("s_bar, azr, zero_z, inverse", [
    (0.0, -0.5, 0.0, 1.0),       # nobody solved it: not learnable under one_minus
    (1 / 8, 7 / 8, 7 / 8, 7 / 8),
    (0.5, 0.5, 0.5, 0.5),
    (7 / 8, 1 / 8, 1 / 8, 1 / 8),
    (1.0, -0.5, 0.0, 0.0),       # everybody solved it: too easy
])
def test_learnability_variants(s_bar, azr, zero_z, inverse):
    assert learnability(s_bar, RewardsConfig()) == pytest.approx(azr)
    assert learnability(s_bar, RewardsConfig(zero_learnability_reward=0.0)) == pytest.approx(zero_z)
    assert learnability(s_bar, RewardsConfig(teacher="inverse")) == pytest.approx(inverse)


def test_learnability_rejects_out_of_range():
    with pytest.raises(ValueError):
        learnability(1.5, RewardsConfig())
    with pytest.raises(ValueError):
        solve_rate([])


def test_teacher_levels():
    cfg = RewardsConfig(format_error=-1.0, invalid_program=-0.75)
    assert teacher_reward("format_error", None, cfg) == -1.0
    assert teacher_reward("invalid", None, cfg) == -0.75
    assert teacher_reward("valid", 0.25, cfg) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        teacher_reward("valid", None, cfg)
    with pytest.raises(ValueError):
        teacher_reward("correct", 0.5, cfg)
