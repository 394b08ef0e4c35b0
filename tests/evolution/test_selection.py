"""Selection faithful to PopuLoRA: the final quiet window and member ages, the
``learnable`` match outcome, newborn protection, one founder lora_A, and the verl path keeping the parent's Adam
moments like the CPU driver."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
import torch

from populora_verl.config import ConfigError, load_config
from populora_verl.evolution.pbt import PBTController
from populora_verl.population import Population, match_outcomes
from populora_verl.population.ratings import STUDENT_WINS, TEACHER_WINS

# --- item 1: no evolution in the final quiet window; ages -------------------------------------------------------


def _fake_adapters(ids):
    g = torch.Generator().manual_seed(0)
    return {i: {"m.lora_A.weight": torch.randn(2, 4, generator=g), "m.lora_B.weight": torch.randn(4, 2, generator=g)}
            for i in ids}


class _StubTasks:
    """Just enough TaskEnv for PopulationStep.begin/on_proposals/on_answers: every proposal is invalid."""

    buffers: dict = {}

    def proposer_request(self, task_type, rng):
        return "propose", {}

    def validate_many(self, items):
        return [(None, "format_error") for _ in items]

    def buffer_tasks(self, task_type, n, rng):
        return []

    def solver_request(self, task):  # pragma: no cover - no valid task ever
        raise AssertionError

    def score_many(self, items):
        return []

    def add_to_buffers(self, tasks):
        pass

    def await_seed_file(self):
        return 0

    def buffers_state(self):
        return {}

    def load_buffers_state(self, state):
        pass

    def close(self):
        pass


def _run(total, interval, **pbt):
    from populora_verl.step import PopulationStep

    cfg = load_config({"population": {"num_teachers": 4, "num_students": 4},
                       "tasks": {"types": ["code_o"]}, "rollout": {"proposals_per_type": 1},
                       "pbt": {"interval_steps": interval, "protect_top": 0, **pbt},
                       "diagnostics": {"cvt_cells": 4, "cvt_samples": 100}})
    ps = PopulationStep(cfg, seed=0, tasks_env=_StubTasks(), total_steps=total)
    events = []
    for step in range(1, total + 1):
        reqs = ps.begin(step)
        ps.on_answers([[] for _ in ps.on_proposals([[f"x{k}" for k in range(r.n)] for r in reqs])])
        plan, _ = ps.maybe_evolve(step, _fake_adapters(ps.population.ids()))
        if plan is not None and len(plan):
            events.append(step)
    return ps, events


def test_last_step_multiple_of_interval_does_not_evolve():
    # Default window = one interval: steps 5 and 6 are quiet, so the last step (6 % 2 == 0) does not evolve.
    ps, events = _run(total=6, interval=2)
    assert events == [2, 4]
    assert [s for s in range(1, 7) if ps.pbt.due(s)] == [2, 4]
    _, events = _run(total=6, interval=2, final_quiet_steps=0)
    assert events == [2, 4, 6]  # today's behaviour, selectable
    _, events = _run(total=6, interval=2, final_quiet_steps=3)
    assert events == [2]


def test_member_ages_count_trained_steps_and_flag_young_members(tmp_path):
    ps, _ = _run(total=6, interval=2, min_age=0, final_quiet_steps=3)
    pop = ps.population
    assert pop.age_window == 3
    founders = [m for m in pop.members if not m.parents]
    children = [m for m in pop.members if m.parents]
    assert founders and children
    for m in founders:
        assert m.age == 6
    for m in children:  # born at step 2 (trained 3..6) or 4 (trained 5..6)
        assert m.age == 6 - m.birth_step
    assert {m.id for m in pop.young()} == {m.id for m in children if m.age < 3}
    pop.save(tmp_path / "pop")
    back, _ = Population.load(tmp_path / "pop")
    assert {m.id: m.age for m in back.lineage} == {m.id: m.age for m in pop.lineage}
    assert back.age_window == 3


def test_old_population_file_without_ages_loads_with_steps_since_birth(tmp_path):
    cfg = load_config({"population": {"num_teachers": 2, "num_students": 2}})
    pop = Population.create(cfg)
    pop.step = 7
    state = pop.state_dict()
    for r in state["lineage"]:
        del r["age"]
    del state["age_window"]
    back = Population.from_state_dict(state)
    assert all(m.age == 7 for m in back.members) and back.age_window is None and back.young() == []


def test_eval_and_report_name_young_members(tmp_path):
    from populora_verl.eval.cli import eval_parser, members_from_args
    from populora_verl.eval.report import build_run_report, young_members

    # As a checkpoint taken mid-run: children born at steps 4 and 6 have trained fewer than 3 steps.
    ps, _ = _run(total=6, interval=2, min_age=0, final_quiet_steps=0)
    ps.population.age_window = 3
    adapters = _fake_adapters(ps.population.ids())
    run = tmp_path / "run"
    ps.population.save(run / "checkpoints" / "step_6" / "population", adapters={
        i: {"base_model.model.m.lora_A.weight": a["m.lora_A.weight"],
            "base_model.model.m.lora_B.weight": a["m.lora_B.weight"]} for i, a in adapters.items()},
        lora_config={"r": 2, "lora_alpha": 2, "target_modules": ["m"]})
    state = json.loads((run / "checkpoints" / "step_6" / "population" / "population.json").read_text())
    young, window = young_members(state)
    expected = {m.id: m.age for m in ps.population.members if m.age < 3}
    assert young == expected and window == 3 and young
    args = eval_parser().parse_args(["--run-dir", str(run), "--no-base"])
    members_from_args(args)
    assert args.young_members == expected and args.age_window == 3
    report = build_run_report(run).read_text()
    assert "age (steps)" in report and "Young members" in report
    for mid in expected:
        assert f"{expected[mid]} (young)" in report and mid in report.split("Young members")[1]


# --- item 8: selection that rewards good teaching ----------------------------------------------------------------


def test_learnable_outcome_makes_unsolvable_tasks_a_teacher_loss():
    # Nobody solved anything: a teacher win under vs_expected, a loss under learnable.
    assert match_outcomes([0.0, 0.0], 0.5, "vs_expected") == [TEACHER_WINS]
    assert match_outcomes([0.0, 0.0], 0.5, "learnable") == [STUDENT_WINS]
    assert match_outcomes([], 0.5, "learnable") == [STUDENT_WINS]  # no valid task
    # Hard but solvable problems still win for the teacher under both rules.
    assert match_outcomes([0.25, 0.125], 0.5, "learnable") == [TEACHER_WINS]
    # Stumping half the problems does not buy a win: 0 -> 1 in the mean.
    assert match_outcomes([0.0, 0.25], 0.5, "learnable") == [STUDENT_WINS]
    assert match_outcomes([0.0, 0.25], 0.5, "vs_expected") == [TEACHER_WINS]


def test_learnable_outcome_counts_invalid_proposals_against_the_teacher():
    assert match_outcomes([0.25], 0.5, "learnable", invalid=3) == [STUDENT_WINS]
    assert match_outcomes([0.25], 0.5, "vs_expected", invalid=3) == [TEACHER_WINS]  # ignored there
    with pytest.raises(ValueError, match="invalid"):
        match_outcomes([0.25], 0.5, "learnable", invalid=-1)


@pytest.mark.parametrize("rule,winner", [("vs_expected", "teacher"), ("learnable", "student")])
def test_step_rates_a_half_invalid_teacher_by_the_outcome_rule(rule, winner, executor):
    from populora_verl.step import GenResponse, PopulationStep

    good = "plan</think>\n<answer>\n```python\ndef f(x):\n    return x + 1\n```\n```input\n3\n```\n</answer>"
    right, wrong = ("4</think>\n<answer>\n```output\n4\n```\n</answer>",
                    "5</think>\n<answer>\n```output\n5\n```\n</answer>")
    cfg = load_config({"population": {"num_teachers": 1, "num_students": 1}, "matchmaking": {"outcome": rule},
                       "tasks": {"types": ["code_o"], "num_references": 1},
                       "rollout": {"teacher_n": 1, "student_n": 4, "proposals_per_type": 2},
                       "diagnostics": {"cvt_cells": 4, "cvt_samples": 100}})
    ps = PopulationStep(cfg, executor=executor, seed=0)
    reqs = ps.begin(1)
    # Two proposals: one valid, one garbage. The student solves the valid one 1 time in 4 (s̄ = 0.25 < p).
    sreqs = ps.on_proposals([GenResponse(r, [good if i == 0 else "garbage"]) for i, r in enumerate(reqs)])
    res = ps.on_answers([GenResponse(r, [right if (k == 0 and r.meta["source"] == "teacher") else wrong
                                         for k in range(r.n)]) for r in sreqs])
    assert res.outcomes[("t0", "s0")] == [winner]


def _aged(nt=4, **pbt):
    cfg = load_config({"population": {"num_teachers": nt, "num_students": 2}, "pbt": {"roles": ["teacher"], **pbt}})
    pop = Population.create(cfg)
    for m in pop.members:
        m.age = 30
    return cfg, pop


def test_newborn_child_is_not_culled_before_min_age():
    cfg, pop = _aged(min_age=20, protect_top=0, cull_fraction=0.25)
    ops = {"mut": type("Op", (), {"kind": "mutation", "num_parents": 1, "defaults": {},
                                  "__call__": lambda self, ps, generator: dict(ps[0])})()}
    ctl = PBTController(cfg.pbt, seed=0, operators=ops)
    adapters = _fake_adapters(pop.ids())
    plan = ctl.plan(pop, 10)
    children = ctl.apply(plan, pop, adapters)
    child = pop.member(plan.replacements[0].child_id)
    assert child.age == 0 and child.parents
    adapters.update(children)
    # The child is by far the weakest, but younger than min_age: the weakest old member dies instead.
    pop.ratings.load_ratings([(m.id, [40.0, 1.0] if m.id != child.id else [0.0, 8.0]) for m in pop.members])
    pop.ratings._ratings[pop.members[1].id] = pop.ratings.env.create_rating(30.0, 1.0)
    plan2 = ctl.plan(pop, 20)
    assert [r.victim_id for r in plan2.replacements] == [pop.members[1].id]
    assert any("min_age" in n for n in plan2.notes) is False  # a victim was still found: no shortfall
    child.age = 20
    plan3 = PBTController(cfg.pbt, seed=0, operators=ops).plan(pop, 30)
    assert [r.victim_id for r in plan3.replacements] == [child.id]
    # min_age = 0 is today's behaviour: the newborn goes at once.
    child.age = 0
    cfg0, _ = _aged(min_age=0, protect_top=0)
    plan4 = PBTController(cfg0.pbt, seed=0, operators=ops).plan(pop, 30)
    assert [r.victim_id for r in plan4.replacements] == [child.id]


def test_all_candidates_newborn_means_no_victim_and_a_note():
    cfg, pop = _aged(nt=2, min_age=20, protect_top=1)
    pop.members[1].parents, pop.members[1].age = ("t0",), 3
    pop.ratings.load_ratings([(m.id, [30.0 - 10 * i, 1.0]) for i, m in enumerate(pop.members)])
    plan = PBTController(cfg.pbt, seed=0, operators={}).plan(pop, 10)
    assert len(plan) == 0 and any("min_age=20" in n for n in plan.notes)


def test_two_member_role_warns_at_start_up(caplog):
    cfg = load_config({"population": {"num_teachers": 2, "num_students": 4}})
    with caplog.at_level(logging.WARNING, logger="populora_verl.evolution.pbt"):
        PBTController(cfg.pbt, seed=0).validate(cfg.population)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "teacher sub-population has 2 members" in msgs[0] and "populora.pbt" in msgs[0]


@pytest.mark.parametrize("bad,key", [({"pbt": {"min_age": -1}}, "populora.pbt.min_age"),
                                     ({"pbt": {"final_quiet_steps": -2}}, "populora.pbt.final_quiet_steps"),
                                     ({"matchmaking": {"outcome": "stumps"}}, "populora.matchmaking.outcome"),
                                     ({"population": {"founder_init": "x"}}, "populora.population.founder_init"),
                                     ({"rollout": {"max_new_tokens": 0}}, "populora.rollout.max_new_tokens")])
def test_new_keys_fail_naming_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value).startswith(key + ":")


@pytest.mark.parametrize("rule,culled", [("vs_expected", "t1"), ("learnable", "t0")])
def test_pbt_culls_the_stumping_teacher_only_under_learnable(rule, culled):
    # t0 stumps its students (every task s̄ = 0); t1 poses learnable tasks (s̄ = 0.25, 0.5, 0.75). Same students,
    # same number of matches: the outcome rule alone decides who PBT replaces.
    cfg = load_config({"population": {"num_teachers": 3, "num_students": 2},
                       "matchmaking": {"outcome": rule}, "pbt": {"roles": ["teacher"], "protect_top": 0}})
    pop = Population.create(cfg)
    for k in range(12):
        s = f"s{k % 2}"
        pop.ratings.rate_match("t0", s, [0.0, 0.0, 0.0], rule)
        pop.ratings.rate_match("t1", s, [0.25, 0.5, 0.75], rule)
        pop.ratings.rate_match("t2", s, [0.125, 0.25, 0.25], rule)  # a good teacher under both rules
    plan = PBTController(cfg.pbt, seed=0, operators={"m": type("Op", (), {"kind": "mutation", "num_parents": 1,
                                                                            "defaults": {}})()}).plan(pop, 10)
    assert [r.victim_id for r in plan.replacements] == [culled]


def test_selection_simulation_runs_and_protects_newborns():
    from populora_verl.bench.selection_sim import SimConfig, simulate, table

    res = simulate(SimConfig(outcome="learnable", min_age=20, steps=40, seeds=2))
    shares = (res.final_learnable, res.final_stump, res.final_invalid)
    assert all(0 < x < 1 for x in shares) and sum(shares) < 1
    assert res.recovering_culled == 0.0  # min_age=20 >= recovery: no child is culled while recovering
    exposed = simulate(SimConfig(outcome="learnable", min_age=0, steps=40, seeds=2))
    assert exposed.recovering_culled > 0.0  # without protection, recovering children are culled
    assert "| learnable | 20 | prior |" in table([(SimConfig(), res)])


# --- item 9: one founder lora_A ----------------------------------------------------------------------------------


def _tiny_bank(shared_a):
    transformers = pytest.importorskip("transformers")
    from peft import LoraConfig, get_peft_model

    from populora_verl.workers.adapter_bank import AdapterBank

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = get_peft_model(transformers.Qwen2ForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bank = AdapterBank(model, opt, None, pin_memory=False)
    bank.init_slots(3, seed=5, shared_a=shared_a)
    return model, opt, bank


@pytest.mark.parametrize("shared", [True, False])
def test_bank_founders_share_lora_a_by_choice(shared):
    _, _, bank = _tiny_bank(shared)
    states = [bank.get_adapter_state(k) for k in range(3)]
    a_keys = [k for k in states[0] if "lora_A" in k]
    same = all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in a_keys)
    assert same is shared
    assert all(float(s[k].abs().max()) > 0 for s in states for k in a_keys)


@pytest.mark.parametrize("shared", [True, False])
def test_cpu_driver_founders_share_lora_a_by_choice(shared):
    pytest.importorskip("peft")
    from populora_verl.local.config import LocalConfig
    from populora_verl.local.hf_engine import HFEngine
    from populora_verl.local.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    eng = HFEngine(build_tiny_model(tok, hidden_size=32), tok, num_slots=3, cfg=LocalConfig(), shared_a=shared)
    states = [eng.get_adapter(s) for s in eng.slots]
    a_keys = [k for k in states[0] if "lora_A" in k]
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in a_keys) is shared


def test_founder_init_default_is_shared_a():
    assert load_config({}).population.founder_init == "shared_a"


# --- item 12: a child keeps its parent's Adam moments on the verl path too ---------------------------------------


def _train(model, opt, seed):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _moments(bank, slot):
    bank.swap_out()
    return {n: st["exp_avg"].clone() for n, st in (bank._slots[slot].optim or {}).items()}


def test_bank_child_keeps_parent_moments_not_victims():
    from populora_verl.workers.adapter_bank import PlanEntry

    model, opt, bank = _tiny_bank(True)
    for slot, seed in ((0, 1), (2, 2)):
        with bank.active(slot):
            _train(model, opt, seed)
    parent, victim = _moments(bank, 0), _moments(bank, 2)
    assert parent and any(not torch.equal(parent[n], victim[n]) for n in parent)

    class _Copy:
        kind, num_parents, defaults = "mutation", 1, {}

        def __call__(self, ps, *, generator):
            return dict(ps[0])

    bank.apply_plan([PlanEntry(child_slot=2, operator="copy", parent_slots=[0], seed=0, reset_optimizer=False)],
                    operators={"copy": _Copy()})
    child = _moments(bank, 2)
    assert all(torch.equal(child[n], parent[n]) for n in parent)
    assert bank.slot_info(2)["optimizer_step"] == bank.slot_info(0)["optimizer_step"] == 1
    # The copy is independent: training the child leaves the parent's moments alone.
    with bank.active(2):
        _train(model, opt, 3)
    assert all(torch.equal(_moments(bank, 0)[n], parent[n]) for n in parent)


def test_verl_evolve_sends_parent_slot_for_its_optimizer(tmp_path, bare_trainer):
    pytest.importorskip("verl")
    from populora_verl.step import PopulationStep

    cfg = load_config({"population": {"num_teachers": 3, "num_students": 3},
                       "pbt": {"interval_steps": 1, "reset_optimizer_on_replace": False, "protect_top": 0,
                               "final_quiet_steps": 0}})
    t = bare_trainer(OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}}), global_steps=1,
                     pop_step=PopulationStep(cfg, seed=0, tasks_env=_StubTasks(), total_steps=10))
    slot_of = {m.id: m.slot for m in t.pop_step.population.members}
    calls = []
    t._get_adapter = t._rpc = None  # the workers make the children from their own slots
    t.timing_raw = {}

    def apply_plan(entries):
        calls.extend(entries)
        return [{"rank": 0, "slots": [e["child_slot"] for e in entries], "timing": {}}]

    t.actor_rollout_wg = SimpleNamespace(populora_apply_plan=apply_plan)
    out = t._evolve()
    assert out["populora/evolution/events"] == 2.0 and len(calls) == 2
    # the verl path logs the event like the CPU driver: one line of evolution.jsonl with both replacements
    event = json.loads((tmp_path / "evolution.jsonl").read_text())
    assert event["step"] == 1 and len(event["replacements"]) == 2
    lineage = {m.id: m for m in t.pop_step.population.lineage}
    for e in calls:
        child = next(m for m in t.pop_step.population.members if m.slot == e["child_slot"])
        assert e["reset_optimizer"] is False  # the workers copy parent_slots[0]'s optimizer: the fitter parent's
        assert e["parent_slots"][0] == slot_of[lineage[child.id].parents[0]] != e["child_slot"]
