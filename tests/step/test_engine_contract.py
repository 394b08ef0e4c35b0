"""The engine contract (populora_verl.step.engine): the seeding rounds and the evolution writes exist once, and
both drivers implement the parts they use: every engine is a PopulationEngine; the CPU driver's LocalEngine makes
children on the driver (a ChildWriter), the verl trainer's TrainerEngine on the workers (a PlanEngine)."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest
import torch

from populora_verl.config import load_config
from populora_verl.evolution.pbt import EvolutionPlan, Replacement
from populora_verl.step import PopulationStep
from populora_verl.step.engine import (SEED_FILE, AdapterView, ChildWriter, Phase, PlanEngine, PopulationEngine,
                                       apply_evolution, evolve, seed_buffers)
from populora_verl.step.records import BASE_POLICY, SEED, STUDENT, TEACHER, GenResponse


class FakeEngine:
    """A PopulationEngine and ChildWriter that records every call and keeps a per-slot "optimizer state" (a label), so a test can
    see which optimizer a child ended up with."""

    def __init__(self, num_slots: int = 6, script=None) -> None:
        self.calls: list[tuple] = []
        self.adapters = {k: {"m.lora_A.weight": torch.full((2, 4), float(k)),
                             "m.lora_B.weight": torch.full((4, 2), float(k))} for k in range(num_slots)}
        self.optim: dict[int, str | None] = {k: f"moments-of-{k}" for k in range(num_slots)}
        self.script = script or (lambda request, phase: ["no idea"] * request.n)

    def generate(self, requests, phase):
        self.calls.append(("generate", phase, len(requests)))
        return [GenResponse(r, self.script(r, phase)) for r in requests]

    def get_adapter(self, slot):
        self.calls.append(("get_adapter", slot))
        return self.adapters[slot]

    def write_child(self, slot, state, optimizer_from):
        self.calls.append(("write_child", slot, optimizer_from))
        self.adapters[slot] = state
        self.optim[slot] = None if optimizer_from is None else self.optim[optimizer_from]

    def writes(self):
        return [c[1:] for c in self.calls if c[0] == "write_child"]


def _replacement(victim, slot, child, parents, *, reset, tie=False):
    return Replacement(victim_id=victim, victim_slot=slot, child_id=child, role="teacher", operator="copy",
                       kind="mutation", parent_ids=tuple(parents), params={}, seed=0, reset_optimizer=reset,
                       tie_break=tie)


def _child(value):
    return {"m.lora_A.weight": torch.full((2, 4), value), "m.lora_B.weight": torch.full((4, 2), value)}


# --- the protocols, and both drivers implementing what they use -------------------------------------------------


def _params(fn):
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def _methods(proto):
    return {name for name, value in vars(proto).items() if callable(value) and not name.startswith("_")}


def _check_implements(cls, *protocols):
    for proto in protocols:
        for name in _methods(proto):
            assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name} is missing"
            assert _params(getattr(cls, name)) == _params(getattr(proto, name)), (cls.__name__, name)


def test_each_protocol_holds_only_what_its_engines_call():
    # writing a child is not part of every engine: the trainer's children are made on the workers
    assert _methods(PopulationEngine) == {"generate", "get_adapter"}
    assert _methods(ChildWriter) == {"write_child"}
    assert _methods(PlanEngine) == {"apply_plan"}


def test_fake_engine_is_a_population_engine_and_a_child_writer():
    assert isinstance(FakeEngine(), PopulationEngine) and isinstance(FakeEngine(), ChildWriter)
    assert not isinstance(FakeEngine(), PlanEngine)
    _check_implements(FakeEngine, PopulationEngine, ChildWriter)
    reader = SimpleNamespace(generate=print, get_adapter=print)
    assert isinstance(reader, PopulationEngine) and not isinstance(reader, ChildWriter)
    # the CPU driver's HF engine has methods of the same names, but is not the contract: it speaks slot names and
    # seeds, not member slots and phases (a runtime protocol check sees names only, so the signatures tell)
    from populora_verl.local.hf_engine import HFEngine

    assert _params(HFEngine.generate) != _params(PopulationEngine.generate)
    assert not issubclass(HFEngine, ChildWriter) and not issubclass(HFEngine, PlanEngine)


def test_the_cpu_driver_makes_children_on_the_driver():
    from populora_verl.local.driver import LocalEngine

    _check_implements(LocalEngine, PopulationEngine, ChildWriter)
    eng = LocalEngine(SimpleNamespace(), str, 0)
    assert isinstance(eng, PopulationEngine) and isinstance(eng, ChildWriter) and not isinstance(eng, PlanEngine)


def test_the_verl_trainer_makes_children_on_the_workers_and_cannot_write_one(bare_trainer):
    pytest.importorskip("verl")
    from omegaconf import OmegaConf

    from populora_verl.trainer.hooks import TrainerEngine

    _check_implements(TrainerEngine, PopulationEngine, PlanEngine)
    assert not hasattr(TrainerEngine, "write_child")
    t = bare_trainer(OmegaConf.create({"trainer": {"default_local_dir": "/nowhere"}}))
    eng = TrainerEngine(t)
    assert isinstance(eng, PopulationEngine) and isinstance(eng, PlanEngine) and not isinstance(eng, ChildWriter)


# --- apply_evolution ----------------------------------------------------------------------------------------------


def test_children_are_written_in_plan_order_with_the_parents_optimizer_or_a_fresh_one(tmp_path):
    eng = FakeEngine()
    slot_of = {"t0": 0, "t1": 1, "t2": 2, "s0": 3, "s1": 4, "s2": 5}
    plan = EvolutionPlan(step=4, replacements=[
        _replacement("t2", 2, "t3", ["t0"], reset=False),
        _replacement("s2", 5, "s3", ["s1", "s0"], reset=True, tie=True),
        _replacement("t1", 1, "t4", ["t0", "s1"], reset=False),
    ])
    children = {"t3": _child(7.0), "s3": _child(8.0), "t4": _child(9.0)}
    out = apply_evolution(plan, children, eng, slot_of, tmp_path)
    assert eng.writes() == [(2, 0), (5, None), (1, 0)]  # plan order; optimizer from parent_ids[0] or fresh
    assert eng.adapters[2] is children["t3"] and eng.adapters[5] is children["s3"] and eng.adapters[1] is children["t4"]
    assert eng.optim[2] == eng.optim[1] == "moments-of-0" and eng.optim[5] is None  # never the victim's own
    assert not [c for c in eng.calls if c[0] != "write_child"]  # the children are made already: nothing is read
    assert out.plan is plan
    assert out.metrics == {"populora/evolution/events": 3.0, "populora/evolution/tie_breaks": 1.0}
    assert out.lines == [
        "[populora] step 4 evolution: t2 (slot 2) <- t3 = copy(t0)",
        "[populora] step 4 evolution: s2 (slot 5) <- s3 = copy(s1, s0) [tie-break: the victim's fitness equals a "
        "survivor's]",
        "[populora] step 4 evolution: t1 (slot 1) <- t4 = copy(t0, s1)",
    ]
    events = [json.loads(x) for x in (tmp_path / "evolution.jsonl").read_text().splitlines()]
    assert len(events) == 1 and events[0]["step"] == 4
    assert [r["child_id"] for r in events[0]["replacements"]] == ["t3", "s3", "t4"]
    # a second event appends a line
    apply_evolution(EvolutionPlan(step=6, replacements=[_replacement("t3", 2, "t5", ["t0"], reset=True)]),
                    {"t5": _child(1.0)}, eng, {**slot_of, "t3": 2}, tmp_path)
    assert [json.loads(x)["step"] for x in (tmp_path / "evolution.jsonl").read_text().splitlines()] == [4, 6]


def test_an_event_without_replacements_writes_nothing_and_logs_no_event(tmp_path):
    eng = FakeEngine()
    out = apply_evolution(EvolutionPlan(step=2, notes=["teacher: protect_top=2 protects all 2 members"]), {}, eng,
                          {"t0": 0}, tmp_path)
    assert eng.calls == [] and out.lines == []
    assert out.metrics == {"populora/evolution/events": 0.0, "populora/evolution/tie_breaks": 0.0}
    assert not (tmp_path / "evolution.jsonl").exists()


def test_apply_evolution_needs_only_a_child_writer(tmp_path):
    written = []
    writer = SimpleNamespace(write_child=lambda slot, state, optimizer_from: written.append((slot, optimizer_from)))
    assert isinstance(writer, ChildWriter) and not isinstance(writer, PopulationEngine)
    plan = EvolutionPlan(step=2, replacements=[_replacement("t2", 2, "t3", ["t0"], reset=False)])
    apply_evolution(plan, {"t3": _child(1.0)}, writer, {"t0": 0, "t2": 2}, tmp_path)
    assert written == [(2, 0)]


@pytest.mark.parametrize("replacements, children, error", [
    # t1 is the source of the first child's optimizer and is overwritten by the second replacement
    ([_replacement("t2", 2, "t3", ["t1"], reset=False), _replacement("t1", 1, "t4", ["t0"], reset=False)],
     {"t3": _child(1.0), "t4": _child(2.0)}, ValueError),
    # the same order reversed: the source would already hold the other child's optimizer
    ([_replacement("t1", 1, "t4", ["t0"], reset=False), _replacement("t2", 2, "t3", ["t1"], reset=False)],
     {"t3": _child(1.0), "t4": _child(2.0)}, ValueError),
    ([_replacement("t2", 2, "t3", ["t0"], reset=True), _replacement("t1", 2, "t4", ["t0"], reset=True)],
     {"t3": _child(1.0), "t4": _child(2.0)}, ValueError),  # one slot written twice
    ([_replacement("t2", 2, "t3", ["t0"], reset=True), _replacement("t1", 1, "t4", ["t0"], reset=True)],
     {"t3": _child(1.0)}, KeyError),  # a child without a state
])
def test_a_plan_that_cannot_hand_on_pre_event_state_is_refused_before_any_write(tmp_path, replacements, children,
                                                                                 error):
    eng = FakeEngine()
    with pytest.raises(error):
        apply_evolution(EvolutionPlan(step=3, replacements=replacements), children, eng,
                        {"t0": 0, "t1": 1, "t2": 2}, tmp_path)
    assert eng.calls == [] and eng.optim[1] == "moments-of-1"
    assert not (tmp_path / "evolution.jsonl").exists()


# --- evolve: PBT on a real PopulationStep, then the writes ---------------------------------------------------------


def _evolving_step(reset: bool) -> PopulationStep:
    from populora_verl.step.task_env import TaskEnv

    cfg = load_config({"population": {"num_teachers": 3, "num_students": 3},
                       "pbt": {"interval_steps": 2, "reset_optimizer_on_replace": reset, "protect_top": 0,
                               "final_quiet_steps": 0}})
    return PopulationStep(cfg, seed=0, tasks_env=TaskEnv(cfg, executor=object()), total_steps=10)


@pytest.mark.parametrize("reset", [False, True])
def test_evolve_reads_only_parents_and_writes_each_child_into_its_victims_slot(tmp_path, reset):
    ps = _evolving_step(reset)
    eng = FakeEngine()
    assert evolve(ps, 1, eng, tmp_path).plan is None and eng.calls == []  # not due: nothing read or written
    slot_before = {m.id: m.slot for m in ps.population.members}
    out = evolve(ps, 2, eng, tmp_path)
    plan = out.plan
    assert plan is not None and len(plan.replacements) == 2  # one victim per role
    parents = {p for r in plan.replacements for p in r.parent_ids}
    assert sorted(c[1] for c in eng.calls if c[0] == "get_adapter") == sorted(slot_before[p] for p in parents)
    assert eng.writes() == [(r.victim_slot, None if reset else slot_before[r.parent_ids[0]])
                            for r in plan.replacements]
    for r in plan.replacements:
        child = ps.population.member(r.child_id)
        assert child.slot == r.victim_slot == slot_before[r.victim_id] and r.victim_id not in ps.population.ids()
        assert eng.optim[child.slot] == (None if reset else f"moments-of-{slot_before[r.parent_ids[0]]}")
    # every rating is still the prior: each cull was a tie-break, and says so
    assert out.metrics == {"populora/evolution/events": 2.0, "populora/evolution/tie_breaks": 2.0}
    assert all(line.startswith("[populora] step 2 evolution: ") and "tie-break" in line for line in out.lines)
    assert len((tmp_path / "evolution.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("engine, missing", [
    (SimpleNamespace(generate=print, get_adapter=print), "no write_child"),  # a PopulationEngine alone
    (SimpleNamespace(generate=print, write_child=print), "no get_adapter"),  # writes children it cannot make
    (SimpleNamespace(generate=print), "no get_adapter or write_child"),
])
def test_evolve_refuses_an_engine_that_can_make_no_child_before_pbt_runs(tmp_path, engine, missing):
    ps = _evolving_step(reset=True)
    before = [(m.id, m.slot) for m in ps.population.members]
    for due in (1, 2):  # refused whether or not an event is due: a wrong engine fails at its first step
        with pytest.raises(TypeError, match=rf"SimpleNamespace .* no apply_plan .* {missing} "):
            evolve(ps, due, engine, tmp_path)
    assert [(m.id, m.slot) for m in ps.population.members] == before
    assert not (tmp_path / "evolution.jsonl").exists()


def test_adapter_view_reads_a_slot_once_and_only_when_asked():
    eng = FakeEngine()
    view = AdapterView(eng, {"t0": 0, "s0": 3})
    assert list(view) == ["t0", "s0"] and len(view) == 2 and eng.calls == []
    assert view["s0"] is view["s0"] is eng.adapters[3]
    assert eng.calls == [("get_adapter", 3)]


# --- seed_buffers on a real PopulationStep (the executor validates the proposals) ---------------------------------


def _seed_step(executor, **buffer):
    cfg = load_config({"population": {"num_teachers": 1, "num_students": 1}, "tasks": {"types": ["code_o"]},
                       "buffer": buffer})
    return PopulationStep(cfg, executor=executor, seed=0)


def _first_request_valid():
    """Per round, the first proposal is a valid new program, the others are not programs at all."""
    counter = iter(range(1, 1000))
    state = {"round": None}

    def script(request, phase):
        if state["round"] == phase.round:
            return ["no idea"] * request.n
        state["round"] = phase.round
        k = next(counter)
        return [f"plan</think>\n<answer>\n```python\ndef f(x):\n    return x + {k}\n```\n```input\n{k}\n```\n"
                "</answer>"] * request.n

    return script


def test_seeding_runs_rounds_until_the_step_reports_seeded(executor, tmp_path):
    ps = _seed_step(executor, seed_programs=3, seed_rounds=10)
    eng = FakeEngine(script=_first_request_valid())
    rounds = seed_buffers(ps, eng, tmp_path / "run")
    # one valid program per round: 3 missing, then 2, then 1, then the step has its seed set
    assert rounds == 3 and ps.seeded and len(ps.seed_set) == 3
    assert [c for c in eng.calls] == [("generate", Phase(SEED, 0, r), n) for r, n in enumerate((3, 2, 1))]
    saved = [json.loads(x) for x in (tmp_path / "run" / SEED_FILE).read_text().splitlines()]
    assert [d["program"] for d in saved] == [t.program for t in ps.seed_set]
    assert ps.seed_begin() == [] and ps.begin(1)  # training may start
    row = ps._pending_metrics
    assert row["populora/seeding/rounds"] == 3.0 and row["populora/seeding/io_programs"] == 3.0


def test_seeding_stops_after_seed_rounds_and_still_saves_what_it_found(executor, tmp_path):
    ps = _seed_step(executor, seed_programs=2, seed_rounds=2)
    eng = FakeEngine()  # never a valid program
    assert seed_buffers(ps, eng, tmp_path) == 2 and ps.seeded and ps.seed_set == []
    assert [c[1].round for c in eng.calls] == [0, 1]
    assert (tmp_path / SEED_FILE).read_text() == ""


def test_no_seeding_round_when_there_is_nothing_to_seed(tmp_path):
    ps = _seed_step(object(), seed_programs=0)
    eng = FakeEngine()
    assert seed_buffers(ps, eng, tmp_path) == 0 and eng.calls == [] and not (tmp_path / SEED_FILE).exists()


# --- the CPU driver's engine ---------------------------------------------------------------------------------------


def test_local_engine_seeds_each_phase_as_the_driver_always_has():
    from populora_verl.local.driver import LocalEngine
    from populora_verl.local.hf_engine import seed_for

    seen = []
    hf = SimpleNamespace(generate=lambda requests, slot_of, seed: seen.append((slot_of, seed)) or [])
    eng = LocalEngine(hf, str.upper, 11)
    for phase in (Phase(SEED, 0, 0), Phase(SEED, 0, 3), Phase(TEACHER, 5), Phase(STUDENT, 5)):
        eng.generate([], phase)
    assert seen == [(str.upper, seed_for(11, 0, 0)), (str.upper, seed_for(11, 0, 3)), (str.upper, seed_for(11, 5, 0)),
                    (str.upper, seed_for(11, 5, 1))]


def _moments(hf, slot):
    return {k: v["exp_avg"].clone() for k, v in hf.optimizer_state(slot)["state"].items()}


def test_local_engine_child_takes_a_copy_of_the_parents_adam_moments_or_a_fresh_optimizer():
    from populora_verl.local.config import LocalConfig
    from populora_verl.local.driver import LocalEngine
    from populora_verl.local.hf_engine import HFEngine
    from populora_verl.local.tiny import build_tiny
    from populora_verl.step import Sample

    model, tok = build_tiny(seed=0)
    hf = HFEngine(model, tok, num_slots=3, cfg=LocalConfig(lr=0.01))
    eng = LocalEngine(hf, lambda member: "slot0", 0)
    ids = tok("def f(a):", add_special_tokens=False)["input_ids"]

    def train(slot, adv):
        hf.update(slot, [Sample("m", "student", "code_o", "p", "r", reward=adv, advantage=adv, length=3,
                                extra=(ids, tok(" return a", add_special_tokens=False)["input_ids"]))])

    train("slot0", 1.0)
    train("slot2", -1.0)
    parent, victim = _moments(hf, "slot0"), _moments(hf, "slot2")
    assert parent and any(not torch.equal(parent[k], victim[k]) for k in parent)
    child = {k: v + 1.0 for k, v in hf.get_adapter("slot0").items()}
    eng.write_child(2, child, 0)
    assert all(torch.equal(hf.get_adapter("slot2")[k], child[k]) for k in child)
    assert all(torch.equal(_moments(hf, "slot2")[k], parent[k]) for k in parent)
    train("slot2", 1.0)  # the copy is the child's own: training it leaves the parent's moments alone
    assert all(torch.equal(_moments(hf, "slot0")[k], parent[k]) for k in parent)
    eng.write_child(1, child, None)
    assert hf.optimizer_state("slot1")["state"] == {}
    assert all(torch.equal(eng.get_adapter(1)[k], child[k]) for k in child)


# --- the verl trainer's engine -------------------------------------------------------------------------------------


def test_trainer_engine_seeds_through_tq_and_clears_the_rows(monkeypatch):
    pytest.importorskip("verl")
    from populora_verl.trainer import hooks
    from populora_verl.trainer.convert import PARTITION

    cleared = []
    monkeypatch.setattr(hooks.tq, "kv_clear", lambda keys, partition_id: cleared.append((keys, partition_id)))

    def _generate(requests, name, metrics):
        metrics[f"populora/rollout/{name}/prompts"] = len(requests)
        return [GenResponse(r, ["x"] * r.n) for r in requests], SimpleNamespace(keys=["k0", "k1"]), {}

    trainer = SimpleNamespace(_generate=_generate, _get_adapter=lambda slot: {"slot": slot})
    eng = hooks.TrainerEngine(trainer)
    from populora_verl.step.records import GenRequest

    req = GenRequest(BASE_POLICY, SEED, "code_o", "p", 1)
    out = eng.generate([req], Phase(SEED, 0, 0))
    assert [r.texts for r in out] == [["x"]] and cleared == [(["k0", "k1"], PARTITION)]  # never trained on
    assert eng.metrics == {"populora/rollout/seed/prompts": 1}
    with pytest.raises(ValueError, match="seeding phase only"):
        eng.generate([req], Phase(TEACHER, 1))
    assert eng.get_adapter(3) == {"slot": 3}


class StoreEngine:
    """The evolution half of an engine over a CPU store (the bench's stand-in for a 7B's LoRA factors, here small):
    the driver's way (get_adapter / write_child, a ChildWriter) and, with ``plans=True``, also a PlanEngine's
    (apply_plan), which evolve prefers."""

    def __init__(self, store, plans: bool) -> None:
        self.store, self.calls = store, []
        if plans:
            self.apply_plan = self._apply_plan

    def generate(self, requests, phase):
        raise AssertionError("evolution generates nothing")

    def get_adapter(self, slot):
        self.calls.append(("get_adapter", slot))
        return self.store.get_adapter_state(slot)

    def write_child(self, slot, state, optimizer_from):
        self.calls.append(("write_child", slot))
        self.store.set_adapter_state(slot, state, reset_optimizer=optimizer_from is None)
        if optimizer_from is not None:
            self.store.copy_optimizer(optimizer_from, slot)

    def _apply_plan(self, entries):
        self.calls.append(("apply_plan", [e["child_slot"] for e in entries]))
        timing = {}
        self.store.apply_plan(entries, timing=timing)
        return timing


def _small_store(layout="bank"):
    from populora_verl.bench.evolution_event import make_store
    from populora_verl.bench.operators import ModelShape

    return make_store(layout, ModelShape(layers=2, hidden=16, intermediate=24, kv_out=8), rank=4, num_slots=6)


@pytest.mark.parametrize("reset", [False, True])
def test_a_plan_engine_makes_the_children_the_driver_would_and_reports_each_phase(tmp_path, reset):
    from populora_verl.workers.adapter_bank import EVOLUTION_PHASES

    driver, workers = StoreEngine(_small_store(), plans=False), StoreEngine(_small_store(), plans=True)
    assert isinstance(workers, PlanEngine) and not isinstance(driver, PlanEngine)
    steps = [_evolving_step(reset) for _ in range(2)]
    a = evolve(steps[0], 2, driver, tmp_path / "driver")
    b = evolve(steps[1], 2, workers, tmp_path / "workers")
    assert a.plan.to_dict() == b.plan.to_dict() and a.metrics == b.metrics and a.lines == b.lines
    assert [c[0] for c in workers.calls] == ["apply_plan"]  # no adapter read or sent by the driver
    assert a.timing == {} and list(b.timing) == list(EVOLUTION_PHASES) and min(b.timing.values()) >= 0
    for k in range(6):  # same weights and optimizer states in every slot, and the same population after
        sa, sb = driver.store.get_adapter_state(k), workers.store.get_adapter_state(k)
        assert all(torch.equal(sa[n], sb[n]) for n in sa), k
        assert driver.store.slot_info(k) == workers.store.slot_info(k)
    assert [(m.id, m.slot, m.parents) for m in steps[0].population.members] == [
        (m.id, m.slot, m.parents) for m in steps[1].population.members]
    assert steps[0].recent_rewards == steps[1].recent_rewards
    assert evolve(steps[1], 3, workers, tmp_path / "workers").plan is None and len(workers.calls) == 1  # not due


def test_a_failed_event_on_the_workers_leaves_the_population_as_it_was(tmp_path):
    class Broken(StoreEngine):
        def _apply_plan(self, entries):
            raise RuntimeError("a rank died")

    ps = _evolving_step(reset=True)
    before = [(m.id, m.slot) for m in ps.population.members]
    with pytest.raises(RuntimeError, match="a rank died"):
        evolve(ps, 2, Broken(_small_store(), plans=True), tmp_path)
    assert [(m.id, m.slot) for m in ps.population.members] == before
    assert not (tmp_path / "evolution.jsonl").exists()


def test_verl_seeding_and_evolution_go_through_the_shared_functions(bare_trainer, tmp_path, monkeypatch, capsys):
    pytest.importorskip("verl")
    from omegaconf import OmegaConf

    from populora_verl.step import engine
    from populora_verl.trainer import hooks

    calls = []
    real_seed, real_evolve = engine.seed_buffers, engine.evolve
    monkeypatch.setattr(hooks, "seed_buffers", lambda *a: calls.append("seed_buffers") or real_seed(*a))
    monkeypatch.setattr(hooks, "evolve", lambda *a: calls.append("evolve") or real_evolve(*a))
    monkeypatch.setattr(hooks.tq, "kv_clear", lambda keys, partition_id: None)
    ps = _evolving_step(reset=True)
    t = bare_trainer(OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path), "resume_mode": "auto"}}),
                     global_steps=2, pop_step=ps)
    t._seed_buffers()  # nothing to seed: no round, no file, no line
    assert not (tmp_path / SEED_FILE).exists()
    slots = {m.slot: m.id for m in ps.population.members}
    slot_of = {m.id: m.slot for m in ps.population.members}
    plans = []
    t._get_adapter = t._rpc = None  # the workers make the children: no adapter is read or sent by the driver

    def apply_plan(entries):  # two ranks, each with its own seconds per phase
        plans.append(entries)
        return [{"rank": 0, "slots": [e["child_slot"] for e in entries],
                 "timing": {"operator": 0.25, "gather": 0.5, "scatter": 0.125, "optimizer": 0.0}},
                {"rank": 1, "slots": [e["child_slot"] for e in entries],
                 "timing": {"operator": 0.5, "gather": 0.5, "scatter": 0.25, "optimizer": 0.0}}]

    t.actor_rollout_wg = SimpleNamespace(populora_apply_plan=apply_plan)
    t.timing_raw = {}
    metrics = t._evolve()
    assert calls == ["seed_buffers", "evolve"]
    assert metrics == {"populora/evolution/events": 2.0, "populora/evolution/tie_breaks": 2.0}
    event = json.loads((tmp_path / "evolution.jsonl").read_text())
    assert plans == [[{"child_slot": r["victim_slot"], "operator": r["operator"],
                       "parent_slots": [slot_of[p] for p in r["parent_ids"]], "seed": r["seed"],
                       "params": r["params"], "reset_optimizer": True} for r in event["replacements"]]]
    # the slowest rank's split (its phases add up to the most), under verl's timing key for the event
    assert t.timing_raw == {"populora_evolve/operator": 0.5, "populora_evolve/gather": 0.5,
                            "populora_evolve/scatter": 0.25, "populora_evolve/optimizer": 0.0}
    for r in event["replacements"]:  # the population took the children once the workers had written them
        assert ps.population.member(r["child_id"]).slot == r["victim_slot"]
        assert r["victim_id"] not in ps.population.ids()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ", 1)[1].split(" ")[0] for line in out] == [slots[r["victim_slot"]]
                                                                      for r in event["replacements"]]
    assert all(line.startswith("[populora] step 2 evolution: ") for line in out)
