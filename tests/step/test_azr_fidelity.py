"""AZR's treatment of proposals whose envelope fails, the per-type outcome metrics, the tie-break flag of an
evolution event, and the TRR++ group keys of the single agent: each test fails if its rule is broken."""

from __future__ import annotations

import json

import pytest
import torch

from populora_verl.advantage import group_keys, trrpp_advantages
from populora_verl.config import PopuLoRAConfig, load_config
from populora_verl.step.metrics import proposal_outcome_metrics
from populora_verl.step.records import TeacherRecord
from populora_verl.tasks import identity_code_f_task, validate_proposal
from populora_verl.tasks.parsing import ParseError, answer_fallback, envelope_problem, extract_answer
from populora_verl.tasks.verify import FAILURE_CODES

PROGRAM = "def f(a, b):\n    return a * b + 1"


@pytest.fixture(scope="module")
def ex(executor_pool):
    return executor_pool.get(timeout_s=2.0, memory_mb=512, max_workers=2)


def blocks(program: str = PROGRAM, inp: str = "3, 4") -> str:
    return f"```python\n{program}\n```\n```input\n{inp}\n```"


# --- the envelope and the program, judged apart ------------------------------------------------------------------


@pytest.mark.parametrize("response,problem", [
    (f"plan: {blocks()}", "no </think>"),                                    # ran out before closing the thought
    (f"plan</think>\n{blocks()}", "no <answer> after </think>"),
    (f"plan</think>\n<answer>\n{blocks()}\n", "<answer> not closed"),        # cut at the token cap
])
def test_a_valid_program_under_a_failed_envelope_is_a_task_with_the_format_penalty(ex, response, problem):
    cfg = PopuLoRAConfig()
    assert envelope_problem(response) == problem
    res = validate_proposal(response, "code_o", ex, cfg)
    assert res.status == "format_error" and res.envelope == problem and not res.valid
    assert res.has_task and res.task.output == "13" and res.code == ""  # AZR's validity counts the program
    assert res.reason.startswith(f"envelope: {problem}")
    strict = load_config({"tasks": {"keep_unformatted_tasks": False}})
    off = validate_proposal(response, "code_o", ex, strict)
    assert off.status == "format_error" and off.task is None and off.code == "envelope"


def test_a_well_formed_proposal_is_unchanged_and_a_bad_program_stays_invalid(ex):
    cfg = PopuLoRAConfig()
    good = validate_proposal(f"ok</think>\n<answer>\n{blocks()}\n</answer>", "code_o", ex, cfg)
    assert good.status == "valid" and good.envelope is None and good.task.output == "13"
    crash = validate_proposal(f"ok</think>\n<answer>\n{blocks(inp='3, 0')}\n</answer>".replace("a * b", "a // b"),
                              "code_o", ex, cfg)
    assert crash.status == "invalid" and crash.code == "execution" and crash.task is None
    both = validate_proposal(blocks(program="import random\ndef f(a, b):\n    return a"), "code_o", ex, cfg)
    assert both.status == "format_error" and both.task is None and both.code == "program"
    assert both.reason.startswith("envelope: no </think>;")


def test_code_f_failure_codes_name_the_missing_inputs(ex):
    cfg = PopuLoRAConfig()
    few = "".join(f"```input\n{i}\n```\n" for i in range(3)) + "```message\nidentity\n```"
    res = validate_proposal(f"t</think>\n<answer>\n{few}\n</answer>", "code_f", ex, cfg,
                            program=identity_code_f_task())
    assert res.status == "format_error" and res.code == "input_count" and "need 10" in res.reason
    six = load_config({"tasks": {"num_inputs": 2}})
    ok = validate_proposal(few, "code_f", ex, six, program=identity_code_f_task())  # no envelope at all
    assert ok.status == "format_error" and ok.has_task and ok.task.inputs == ["1", "2"]


def test_fallback_reading_order():
    assert answer_fallback("x<answer>A</answer> y <answer>B") == "A"     # the last complete pair
    assert answer_fallback("x</think> y <answer>B") == "B"                # else what follows the cut-off <answer>
    assert answer_fallback("x</think> tail") == "tail"
    assert answer_fallback("all of it") == "all of it"
    with pytest.raises(ParseError, match="longer than 8 characters"):  # never parsed, like extract_answer
        answer_fallback("x" * 9, max_chars=8)


def test_extract_answer_never_reads_a_trailing_unclosed_answer_after_a_complete_pair():
    text = "t</think><answer>kept</answer> then <answer>cut off at the token cap"
    assert extract_answer(text) == "kept"
    with pytest.raises(ParseError):
        extract_answer("t</think><answer>cut off only")


# --- metrics --------------------------------------------------------------------------------------------------------


def test_outcome_metrics_split_format_errors_from_validity_per_type():
    task = object()
    def rec(task_type, status, task, code):
        return TeacherRecord("t0", task_type, "prompt", "response", 1, None, task, status, code)

    recs = [
        rec("code_o", "valid", task, ""),
        rec("code_o", "format_error", task, ""),
        rec("code_o", "format_error", None, "blocks"),
        rec("code_o", "invalid", None, "execution"),
        rec("code_f", "format_error", None, "input_count"),
    ]
    m = proposal_outcome_metrics(recs)
    assert m["populora/task_type/code_o/format_error_rate"] == 0.5
    assert m["populora/task_type/code_o/unformatted_valid_rate"] == 0.25
    assert m["populora/task_type/code_o/fail/blocks"] == m["populora/task_type/code_o/fail/execution"] == 0.25
    assert m["populora/task_type/code_f/fail/input_count"] == 1.0
    assert all(f"populora/task_type/code_o/fail/{c}" in m for c in FAILURE_CODES)  # no gaps in a plot


def test_the_population_step_gives_a_valid_unformatted_task_to_students_and_the_teacher_minus_one(ex):
    """Through the real step: the teacher's task reaches the student, the teacher gets rewards.format_error."""
    from populora_verl.step import PopulationStep

    cfg = load_config({"population": {"num_teachers": 1, "num_students": 1}, "tasks": {"types": ["code_o"]},
                       "rollout": {"proposals_per_type": 1, "student_n": 2}, "buffer": {"seed_programs": 0},
                       "pbt": {"enabled": False}})
    ps = PopulationStep(cfg, executor=ex, seed=0)
    reqs = ps.begin(1)
    student = ps.on_proposals([[f"plan {blocks()}"] for _ in reqs])  # no </think>: format error, valid program
    from_teacher = [r for r in student if r.meta["source"] == "teacher"]
    assert len(from_teacher) == 1 and from_teacher[0].meta["task"].output == "13"
    answer = "t</think><answer>\n```output\n13\n```\n</answer>"
    result = ps.on_answers([[answer] * r.n for r in student])
    teacher = [s for s in result.samples if s.role == "teacher"]
    assert [s.reward for s in teacher] == [cfg.rewards.format_error] and teacher[0].meta["status"] == "format_error"
    assert result.metrics["populora/validity/mean"] == 1.0  # AZR counts the program
    assert result.metrics["populora/role/teacher/format_error_rate"] == 1.0
    assert result.metrics["populora/compute/planned_trajectories"] > 0


# --- evolution: a cull decided by the random tie order says so ------------------------------------------------------


def test_a_cull_among_tied_members_is_flagged_as_a_tie_break(tmp_path):
    from populora_verl.evolution.pbt import PBTController, append_event
    from populora_verl.population import Population

    cfg = load_config({"population": {"num_teachers": 2, "num_students": 2}, "pbt": {"min_age": 0}})
    pop = Population.create(cfg)
    pbt = PBTController(cfg.pbt, seed=0)
    plan = pbt.plan(pop, step=5)
    assert plan.replacements and all(r.tie_break for r in plan.replacements)  # every rating still the prior
    # separate the ratings: the weakest of each role now loses on fitness alone
    pop.ratings.load_ratings([(i, [mu, 2.0]) for i, mu in {"t0": 30.0, "t1": 20.0, "s0": 30.0, "s1": 20.0}.items()])
    plan = pbt.plan(pop, step=10)
    assert plan.replacements and not any(r.tie_break for r in plan.replacements)
    assert {r.victim_id for r in plan.replacements} == {"t1", "s1"}
    append_event(tmp_path, plan)
    event = json.loads((tmp_path / "evolution.jsonl").read_text())
    assert event["step"] == 10 and event["replacements"][0]["tie_break"] is False


# --- TRR++ groups ---------------------------------------------------------------------------------------------------


def test_the_single_agents_teacher_and_student_samples_never_share_a_baseline():
    """One adapter plays both roles: its proposer rewards (-1 .. 1) and solver rewards must be whitened apart, or a
    good solver step would read as a bad proposer step."""
    keys = group_keys(["a0"] * 4, ["code_o"] * 4, ["teacher", "teacher", "student", "student"], None,
                      "adapter_task_role")
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]
    rewards = torch.tensor([[-1.0], [1.0], [0.5], [1.0]])
    adv, _ = trrpp_advantages(rewards, torch.ones(4, 1), keys)
    # each role centred on its own mean: the student who scored 0.5 is below its group, not above a -1 teacher
    assert float(adv[2, 0]) < 0 < float(adv[3, 0]) and float(adv[0, 0]) < 0 < float(adv[1, 0])
    assert float(adv[:2].sum()) == pytest.approx(0.0, abs=1e-5) and float(adv[2:].sum()) == pytest.approx(0.0, abs=1e-5)
