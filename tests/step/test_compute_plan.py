"""Compute per adapter: the plan a config makes by role, the start-up check that refuses a plan that is not matched,
and every step's realised trajectories against the plan (every population size, evolution in the middle of a run)."""

from __future__ import annotations

import logging
import zlib
from collections import Counter

import pytest
import torch

from populora_verl.config import ConfigError, load_config
from populora_verl.step import PopulationStep, check_compute_plan, compute_plan
from populora_verl.step.compute import ComputePlan, compare_to_plan
from populora_verl.step.task_env import TaskEnv
from populora_verl.tasks.task import Task

from _shared import answer_with


def test_the_plan_by_role_follows_the_config_keys():
    """Teacher: teacher_n x proposals_per_type x types. Student: teachers met (T·k/S) x those tasks x trained answers
    per task. The single agent: its proposals plus its solver batch."""
    base = compute_plan(load_config({}))  # 4T4S, 1 x 4 x 3 = 12 proposals, 8 answers each
    assert (base.teacher, base.student, base.mean) == (12.0, 96.0, 54.0)
    assert base.of_role("teacher") == 12.0 and base.of_role("student") == 96.0
    single = compute_plan(load_config({"population": {"mode": "single_agent"}, "rollout": {"proposals_per_type": 9,
                                       "buffer_task_n": 1}, "buffer": {"student_mix": "max_new"},
                                       "rewards": {"train_on_estimation_rollouts": False}}))
    assert (single.teacher, single.student, single.of_role("both"), single.mean) == (27.0, 27.0, 54.0, 54.0)
    two_per = compute_plan(load_config({"population": {"num_teachers": 2, "num_students": 4},
                                        "matchmaking": {"students_per_problem": 2}}))
    assert two_per.student == 96.0  # 2 x 2 matches over 4 students: one teacher each
    fewer = compute_plan(load_config({"population": {"num_teachers": 4, "num_students": 2}}))
    assert fewer.student == 192.0 and fewer.mean == (4 * 12 + 2 * 192) / 6
    both = compute_plan(load_config({"buffer": {"student_mix": "max_new"}, "rollout": {"buffer_task_n": 1}}))
    assert both.student == 12 * (8 + 1)  # estimation answers and the max_new batch
    alike = compute_plan(load_config({"buffer": {"student_mix": "max_new"}, "rollout": {"buffer_task_n": 1},
                                      "rewards": {"train_on_estimation_rollouts": False}}))
    assert alike.teacher == alike.student == 12.0  # the role-alike plan of docs/tasks-and-rewards.md


@pytest.mark.parametrize("over, key", [
    ({"population": {"num_teachers": 2, "num_students": 3}}, "populora.population.num_students"),
    ({"population": {"num_teachers": 3, "num_students": 2}, "matchmaking": {"students_per_problem": 1}},
     "populora.population.num_students"),
    ({"tasks": {"probabilities": [1.0, 1.0, 2.0]}}, "populora.tasks.probabilities"),
    ({"rollout": {"buffer_task_n": 1}}, "populora.rollout.buffer_task_n"),
    ({"rewards": {"train_on_estimation_rollouts": False}}, "populora.rewards.train_on_estimation_rollouts"),
])
def test_start_up_check_refuses_a_plan_that_is_not_matched_naming_the_keys(over, key):
    with pytest.raises(ConfigError) as e:
        check_compute_plan(load_config(over))
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg


@pytest.mark.parametrize("over", [
    {}, {"population": {"num_teachers": 2, "num_students": 4}, "matchmaking": {"students_per_problem": 2}},
    {"population": {"num_teachers": 4, "num_students": 2}}, {"rollout": {"buffer_task_n": 8}},
    {"population": {"mode": "single_agent"}, "buffer": {"student_mix": "max_new"}, "rollout": {"buffer_task_n": 1},
     "rewards": {"train_on_estimation_rollouts": False}},
])
def test_start_up_check_passes_matched_plans(over):
    cfg = load_config(over)
    assert check_compute_plan(cfg) == compute_plan(cfg)


class _ScriptedTasks(TaskEnv):
    """Validation and scoring without an executor: a proposal ``VALID`` becomes a fresh task (a new program each
    time, so buffers grow), anything else is a format error; an answer ``RIGHT`` is correct."""

    def validate_many(self, items):
        out = []
        for task_type, text, _meta, teacher, step in items:
            if text != "VALID":
                out.append((None, "format_error", "envelope"))
                continue
            self._n = getattr(self, "_n", 0) + 1
            task = Task(task_type, f"def f(a):\n    return a + {self._n}\n", input="1", output=repr(1 + self._n),
                        teacher=teacher, step=step)
            out.append((task, "valid", ""))
        return out

    def score_many(self, items):
        return [(1.0, True, "correct") if text == "RIGHT" else (-0.5, False, "wrong") for _, text in items]


def _step_config(n: int, **over):
    base = {"population": {"num_teachers": n, "num_students": n} if n else {"mode": "single_agent"},
            "tasks": {"types": ["code_o", "code_i"], "num_references": 1},
            "rollout": {"teacher_n": 1, "student_n": 2, "proposals_per_type": 2},
            "pbt": {"interval_steps": 3, "final_quiet_steps": 0, "min_age": 0},
            "diagnostics": {"cvt_cells": 8, "cvt_samples": 200}}
    if not n:
        base.update(buffer={"student_mix": "max_new"}, rewards={"train_on_estimation_rollouts": False})
        base["rollout"]["buffer_task_n"] = 1
    for k, v in over.items():
        base.setdefault(k, {}).update(v)
    return load_config(base)


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"m.lora_A.weight": torch.randn(2, 4, generator=g), "m.lora_B.weight": torch.randn(4, 2, generator=g)}


def _steps(cfg, seed: int, steps: int):
    """Runs ``steps`` population steps with scripted answers (about half of the proposals valid, answers right and
    wrong) and PBT on its interval; yields ``(step object, step, student requests, result)``."""
    ps = PopulationStep(cfg, seed=seed, tasks_env=_ScriptedTasks(cfg))
    adapters = {m: _adapter(i) for i, m in enumerate(ps.population.ids())}
    for step in range(1, steps + 1):
        teacher_reqs = ps.begin(step)
        student_reqs = ps.on_proposals(answer_with(
            teacher_reqs, lambda r, k: "VALID" if zlib.crc32(r.prompt.encode()) % 2 else "no idea"))
        result = ps.on_answers(answer_with(student_reqs, lambda r, k: "RIGHT" if k % 2 else "WRONG"))
        yield ps, step, student_reqs, result
        _, children = ps.maybe_evolve(step, adapters)
        adapters = {m: adapters.get(m, children.get(m)) for m in ps.population.ids()}


@pytest.mark.parametrize("n", range(0, 9))
def test_every_adapter_trains_its_plan_on_every_step(n, caplog):
    """1T1S ... 8T8S and the single agent (n = 0), three seeds, evolution every 3 steps: on every step each student
    answers the same number of tasks (its teacher's 4, valid or stand-ins), each adapter's realised trajectories
    equal its role's plan, and no step warns."""
    cfg = _step_config(n)
    plan = check_compute_plan(cfg)
    per_teacher = 4  # 1 x 2 proposals x 2 types
    with caplog.at_level(logging.WARNING, logger="populora_verl.step.orchestration"):
        for seed in range(3):
            for ps, step, student_reqs, result in _steps(cfg, seed, 10):
                m = result.metrics
                students = [x.id for x in ps.population.students()]
                trained = cfg.rewards.train_on_estimation_rollouts
                tasks = Counter(r.adapter for r in student_reqs if trained or r.meta["source"] == "buffer")
                assert tasks == {s: per_teacher for s in students}, (n, seed, step, tasks)
                for member in ps.population.members:
                    planned = plan.of_role(member.role)
                    assert len(result.updates[member.id]) == planned, (n, seed, step, member.id)
                    assert m[f"populora/compute/{member.id}/planned"] == planned
                    assert m[f"populora/compute/{member.id}/realised"] == planned
                    assert m[f"populora/compute/{member.id}/trajectories"] == planned
                    assert m[f"populora/compute/{member.id}/updates"] == 1.0
                assert m["populora/compute/max_plan_deviation"] == 0.0
            births = sum(x.birth_step > 0 for x in ps.population.lineage)
            assert births >= 6 if n >= 2 else births == 0  # events at steps 3, 6, 9 (a role of one cannot evolve)
    assert not [r for r in caplog.records if "off the plan" in r.getMessage()]


def test_a_step_off_its_plan_logs_the_deviation_and_warns_in_one_line(caplog):
    """One student trained twice and another not at all (what the old matchmaking could do): both are named."""
    cfg = _step_config(2)
    ps = PopulationStep(cfg, seed=0, tasks_env=_ScriptedTasks(cfg))
    reqs = ps.begin(1)
    ps._pairs = [("t0", "s0"), ("t1", "s0")]
    sreqs = ps.on_proposals(answer_with(reqs, lambda r, k: "no idea"))
    with caplog.at_level(logging.WARNING, logger="populora_verl.step.orchestration"):
        result = ps.on_answers(answer_with(sreqs, lambda r, k: "WRONG"))
    m = result.metrics
    assert (m["populora/compute/s0/planned"], m["populora/compute/s0/realised"]) == (8.0, 16.0)
    assert (m["populora/compute/s1/planned"], m["populora/compute/s1/realised"]) == (8.0, 0.0)
    assert m["populora/compute/max_plan_deviation"] == 1.0
    lines = [r.getMessage() for r in caplog.records if "off the plan" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "step 1" in lines[0] and "s0 16 (planned 8)" in lines[0] and "s1 0 (planned 8)" in lines[0]
    assert "t0" not in lines[0]


def test_compare_to_plan_tolerates_ten_percent():
    plan = ComputePlan("population", teacher=10.0, student=20.0, num_teachers=1, num_students=1)
    roles = {"t0": "teacher", "s0": "student"}

    def updates(t, s):
        return {"t0": [object()] * t, "s0": [object()] * s}

    metrics, warning = compare_to_plan(plan, roles, updates(10, 20))
    assert warning is None and metrics["populora/compute/max_plan_deviation"] == 0.0
    metrics, warning = compare_to_plan(plan, roles, updates(9, 22))  # 10 % under, 10 % over: on plan
    assert warning is None and metrics["populora/compute/max_plan_deviation"] == pytest.approx(0.1)
    metrics, warning = compare_to_plan(plan, roles, updates(10, 23))
    assert warning.startswith("trained trajectories off the plan by more than 10%: s0 23 (planned 20)")
    assert metrics["populora/compute/max_plan_deviation"] == pytest.approx(0.15)
