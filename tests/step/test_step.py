"""The population step's phase API with hand-written responses: rewards, teacher learnability from the matched
student, ratings, TRR++ per adapter, buffer fallback, single-agent mode, evolution lineage, state round trip."""

from __future__ import annotations

import json

import pytest
import torch

from populora_verl.step import GenResponse, PopulationStep

from _shared import GARBAGE, GOOD_PROPOSAL, RIGHT, WRONG, answer_with, small_step_config  # noqa: E402

def test_teacher_reward_is_learnability_of_matched_student(executor):
    ps = PopulationStep(small_step_config(), executor=executor, seed=0)
    teacher_reqs = ps.begin(1)
    assert [(r.adapter, r.role, r.task_type) for r in teacher_reqs] == [("t0", "teacher", "code_o"),
                                                                         ("t1", "teacher", "code_o")]
    assert "Hello world" in teacher_reqs[0].prompt  # the identity seed is the buffer reference
    pairs = dict(ps._pairs)
    student_reqs = ps.on_proposals(answer_with(teacher_reqs,
                                               lambda r, k: GOOD_PROPOSAL if r.adapter == "t0" else GARBAGE))
    from_t0 = [r for r in student_reqs if r.meta["source"] == "teacher"]
    assert [r.adapter for r in from_t0] == [pairs["t0"]] and from_t0[0].n == 4
    assert "return x + 1" in from_t0[0].prompt
    # t1 proposed nothing valid: its matched student gets a buffer task (the identity seed) instead.
    fallback = [r for r in student_reqs if r.meta["source"] == "buffer"]
    assert [r.adapter for r in fallback] == [pairs["t1"]] and "Hello world" in fallback[0].prompt

    mu_before = {m: ps.population.ratings.mu(m) for m in ("t0", "t1")}
    # The matched student of t0 solves 1 of 4: s̄ = 0.25, so t0 earns 1 - 0.25.
    result = ps.on_answers(answer_with(student_reqs, lambda r, k: RIGHT if (r.meta["source"] == "teacher" and k == 0)
                                   else WRONG))
    teacher = {s.adapter: s for s in result.samples if s.role == "teacher"}
    assert teacher["t0"].reward == pytest.approx(0.75)
    assert teacher["t1"].reward == -1.0
    assert result.solve_rates == {("t0", pairs["t0"]): 0.25}
    assert result.metrics[f"populora/pair/t0/{pairs['t0']}/solve_rate"] == 0.25
    assert result.metrics["populora/validity/t0"] == 1.0 and result.metrics["populora/validity/t1"] == 0.0
    # Fallback answers train the student but never count for t1's reward or the pair's solve rate.
    student = [s for s in result.samples if s.adapter == pairs["t0"]]
    assert sorted(s.reward for s in student) == [-0.5, -0.5, -0.5, 1.0]
    # TRR++ within the adapter: its 4 answers are whitened to mean 0, the correct one above the rest.
    adv = [s.advantage for s in student]
    assert abs(sum(adv)) < 1e-6 and max(adv) == [s.advantage for s in student if s.reward == 1.0][0] > 0
    # A lone sample in its (adapter, task, role) group has advantage 0.
    assert teacher["t0"].advantage == 0.0
    # Ratings: t0's student was expected to win half the time and solved 0.25 -> the teacher won.
    assert ps.population.ratings.mu("t0") > mu_before["t0"]
    # t1 posed nothing valid: a student win.
    assert ps.population.ratings.mu("t1") < mu_before["t1"]
    assert set(result.updates) == {"t0", "t1", "s0", "s1"}
    assert all(s.adapter == a for a, xs in result.updates.items() for s in xs)
    # The valid task entered the code_o buffer.
    assert any("x + 1" in t.program for t in ps.tasks.buffers["code_o"])


def test_single_agent_is_the_same_code(executor):
    ps = PopulationStep(small_step_config(population={"mode": "single_agent"}), executor=executor, seed=0)
    reqs = ps.begin(1)
    assert [(r.adapter, r.role) for r in reqs] == [("a0", "teacher")]
    sreqs = ps.on_proposals(answer_with(reqs, lambda r, k: GOOD_PROPOSAL))
    assert [(r.adapter, r.role) for r in sreqs] == [("a0", "student")]
    res = ps.on_answers(answer_with(sreqs, lambda r, k: RIGHT if k < 3 else WRONG))
    assert [s.reward for s in res.samples if s.role == "teacher"] == [pytest.approx(0.25)]
    assert set(res.updates) == {"a0"} and len(res.updates["a0"]) == 5
    assert ps.population.ratings.mu("a0") == 25.0  # not rated against itself
    assert ps.maybe_evolve(1, {}) == (None, {})


def test_phase_order_and_response_counts_are_checked(executor):
    ps = PopulationStep(small_step_config(), executor=executor, seed=0)
    with pytest.raises(RuntimeError):
        ps.on_answers([])
    reqs = ps.begin(1)
    with pytest.raises(ValueError, match="samples"):
        ps.on_proposals([["only one", "too many"] for _ in reqs])


def _adapters(ids, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: {"m.lora_A.weight": torch.randn(4, 8, generator=g), "m.lora_B.weight": torch.randn(8, 4, generator=g)}
            for i in ids}


def test_crossover_child_has_both_parents_in_lineage(executor):
    cfg = small_step_config(population={"num_teachers": 3, "num_students": 3},
                            pbt={"crossover_rate": 1.0, "operators": {"layer_crossover": 1.0}, "protect_top": 0})
    ps = PopulationStep(cfg, executor=executor, seed=0)
    plan, children = ps.maybe_evolve(1, _adapters(ps.population.ids()))
    assert len(plan.replacements) == 2 and set(children) == {"t3", "s3"}
    for r in plan.replacements:
        child = ps.population.member(r.child_id)
        assert r.kind == "crossover" and len(child.parents) == 2 and set(child.parents) == set(r.parent_ids)
        assert all(ps.population.member(p).alive for p in child.parents)
        assert child.slot == r.victim_slot and not ps.population.member(r.victim_id).alive
        assert child.operator == "layer_crossover" and child.birth_step == 1


def test_state_dict_round_trip(executor, tmp_path):
    from populora_verl.checkpoint import load_checkpoint, save_checkpoint

    ps = PopulationStep(small_step_config(), executor=executor, seed=3)
    sreqs = ps.on_proposals(answer_with(ps.begin(1), lambda r, k: GOOD_PROPOSAL))
    ps.on_answers(answer_with(sreqs, lambda r, k: RIGHT if k % 2 else WRONG))
    adapters = _adapters(ps.population.ids())
    save_checkpoint(tmp_path, 1, population=ps.population, adapters=adapters,
                    lora_config={"r": 4, "lora_alpha": 8, "target_modules": ["m"]}, optimizers={},
                    step_state=ps.state_dict())
    ck = load_checkpoint(tmp_path)
    other = PopulationStep(small_step_config(), executor=executor, seed=99)
    other.load_state_dict(ck.step_state, population=ck.population)
    a, b = ps.state_dict(), other.state_dict()
    cov_a, cov_b = a.pop("coverage"), b.pop("coverage")
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    assert all((cov_a[k] == cov_b[k]).all() for k in cov_a)
    assert ck.population.ratings.state_dict() == ps.population.ratings.state_dict()
    assert all(torch.equal(ck.adapters[m][k], adapters[m][k]) for m in adapters for k in adapters[m])
    # The next step continues identically from both.
    assert [r.prompt for r in ps.begin(2)] == [r.prompt for r in other.begin(2)]
    assert ps._pairs == other._pairs


def test_step_metrics_validity_per_task_type_and_length_per_role(executor):
    """The --compare report's per-type validity and per-role response length come from the step's own metrics."""
    ps = PopulationStep(small_step_config(tasks={"types": ["code_o", "code_i"]}), executor=executor, seed=0)
    teacher_reqs = ps.begin(1)
    # code_o proposals are valid, code_i ones garbage; teachers write 7 tokens, students 3.
    responses = [GenResponse(r, [GOOD_PROPOSAL if r.task_type == "code_o" else GARBAGE] * r.n, lengths=[7] * r.n)
                 for r in teacher_reqs]
    student_reqs = ps.on_proposals(responses)
    result = ps.on_answers([GenResponse(r, [RIGHT] * r.n, lengths=[3] * r.n) for r in student_reqs])
    m = result.metrics
    assert m["populora/task_type/code_o/validity"] == 1.0 and m["populora/task_type/code_i/validity"] == 0.0
    assert m["populora/role/teacher/response_length_mean"] == 7.0
    assert m["populora/role/student/response_length_mean"] == 3.0


@pytest.mark.parametrize("rewards", [{}, {"format_error": -0.5, "wrong_answer": -0.5}],
                         ids=["azr_levels", "format_error_priced_as_wrong"])
def test_step_metrics_format_error_rate_per_role(executor, rewards):
    """The envelope failure rate per role (what a weak base model gets wrong first) counts every generated text,
    from the scorer's status: it stays right when a config prices a format error like a wrong answer."""
    ps = PopulationStep(small_step_config(tasks={"types": ["code_o", "code_i"]}, rewards=rewards), executor=executor,
                        seed=0)
    teacher_reqs = ps.begin(1)
    # Half the teachers' prompts (the code_i ones) get garbage: a format error, not an invalid program.
    responses = [GenResponse(r, [GOOD_PROPOSAL if r.task_type == "code_o" else GARBAGE] * r.n) for r in teacher_reqs]
    student_reqs = ps.on_proposals(responses)
    # Students: one in four answers has no answer envelope at all; the rest are right or wrong answers.
    answers = [GenResponse(r, [GARBAGE if k % 4 == 0 else (RIGHT if k % 2 else WRONG) for k in range(r.n)])
               for r in student_reqs]
    n_answers = sum(r.n for r in student_reqs)
    m = ps.on_answers(answers).metrics
    assert m["populora/role/teacher/format_error_rate"] == 0.5
    expected = sum(k % 4 == 0 for r in student_reqs for k in range(r.n)) / n_answers
    assert m["populora/role/student/format_error_rate"] == pytest.approx(expected) and 0 < expected < 1
