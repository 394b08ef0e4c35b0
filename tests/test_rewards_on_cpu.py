"""Reward levels from RewardsConfig and the driver-side teacher reward assembly (population and single agent)."""

from __future__ import annotations

import pytest

from populora_verl.config import RewardsConfig, load_config
from populora_verl.reward import (TeacherSample, assemble_teacher_rewards, learnability, solve_rate, solvers_for,
                                  student_reward, teacher_reward)


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


def test_assemble_teacher_rewards_from_matched_student_solves():
    cfg = load_config({"rewards": {"zero_learnability_reward": -0.5}}).rewards
    samples = [TeacherSample("valid", "task_a"), TeacherSample("valid", "task_b"), TeacherSample("valid", "task_c"),
               TeacherSample("invalid"), TeacherSample("format_error")]
    # The matched student's n=8 answers per task: True/False or 1.0/0.0 (a format error counts as 0).
    correctness = {"task_a": [True] * 2 + [False] * 6, "task_b": [1.0] * 8, "task_c": [0.0] * 8}
    assert assemble_teacher_rewards(samples, correctness, cfg) == pytest.approx([0.75, -0.5, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="task_z"):
        assemble_teacher_rewards([TeacherSample("valid", "task_z")], correctness, cfg)


def test_single_agent_uses_the_same_function_with_its_own_solves():
    cfg = RewardsConfig()
    pairs = [("t0", "s1"), ("t1", "s0"), ("t0", "s2")]
    assert solvers_for("t0", pairs) == ["s1", "s2"]
    assert solvers_for("a0", [], mode="single_agent") == ["a0"]
    with pytest.raises(ValueError):
        solvers_for("t0", pairs, mode="other")
    # AZR: the proposer's own solver samples give s̄; identical rewards for identical solve records.
    own = {"t": [True, False, False, False]}
    assert assemble_teacher_rewards([TeacherSample("valid", "t")], own, cfg) == [0.75]
