"""PBT controller: victim counts, parent/operator choice, lineage, child ratings, config errors, apply()."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from populora_verl.config import ConfigError, load_config
from populora_verl.evolution.pbt import EvolutionPlan, PBTController, num_victims
from populora_verl.population import Population


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(2):
        for mod, (d_in, d_out) in {"q_proj": (12, 12), "v_proj": (12, 6)}.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            sd[f"{pre}.lora_A.weight"] = torch.randn(4, d_in, generator=g)
            sd[f"{pre}.lora_B.weight"] = torch.randn(d_out, 4, generator=g)
    return sd


@dataclass
class FakeOp:
    """Follows the operator contract; records the parents it was given."""

    name: str
    kind: str
    defaults: dict = field(default_factory=lambda: {"scale": 1.0})
    calls: list = field(default_factory=list)

    @property
    def num_parents(self) -> int:
        return 2 if self.kind == "crossover" else 1

    def __call__(self, parents, *, generator, scale=1.0):
        self.calls.append(len(parents))
        noise = torch.rand((), generator=generator).item()
        return {k: sum(p[k] for p in parents) / len(parents) * scale + noise for k in parents[0]}


def _fake_ops():
    return {"mut": FakeOp("mut", "mutation"), "cross": FakeOp("cross", "crossover")}


def _setup(nt=4, ns=4, ops=None, **pbt):
    cfg = load_config({"population": {"num_teachers": nt, "num_students": ns}, "pbt": pbt})
    pop = Population.create(cfg)
    # Distinct ratings: t_i / s_i get mu = 20 + i, so index 0 is the weakest.
    pop.ratings.load_ratings([(m.id, [20.0 + int(m.id[1:]), 2.0]) for m in pop.members])
    ctl = PBTController(cfg.pbt, seed=5, operators=ops if ops is not None else _fake_ops())
    return cfg, pop, ctl


# --- victim counts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5, 0.75, 0.99])
def test_num_victims_never_all_at_least_one(fraction):
    for n in range(1, 9):
        k = num_victims(n, fraction, protect_top=0)
        if n == 1:
            assert k == 0
        else:
            assert 1 <= k <= n - 1
            assert k == min(max(math.floor(n * fraction), 1), n - 1)
        assert num_victims(n, fraction, protect_top=n) == 0


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_plan_victims_are_the_weakest(n, fraction):
    cfg, pop, ctl = _setup(nt=n, ns=n, cull_fraction=fraction, protect_top=0)
    plan = ctl.plan(pop, step=10)
    expected = num_victims(n, fraction)
    for role, prefix in (("teacher", "t"), ("student", "s")):
        victims = [r.victim_id for r in plan.replacements if r.role == role]
        assert len(victims) == expected
        assert sorted(victims) == sorted(f"{prefix}{i}" for i in range(expected))  # lowest mu - 3 sigma
        survivors = {m.id for m in pop.members if m.role == role} - set(victims)
        for r in plan.replacements:
            if r.role == role:
                assert set(r.parent_ids) <= survivors
    if n == 1:
        assert len(plan.notes) == 2 and all("cannot evolve" in x for x in plan.notes)


def test_protect_top_is_respected():
    _, pop, ctl = _setup(nt=3, ns=3, cull_fraction=0.9, protect_top=2)
    plan = ctl.plan(pop, 10)
    assert sorted(r.victim_id for r in plan.replacements) == ["s0", "t0"]
    _, pop, ctl = _setup(nt=2, ns=2, protect_top=2)
    plan = ctl.plan(pop, 10)
    assert plan.replacements == [] and all("protect" in n for n in plan.notes)


def test_fitness_choices():
    _, pop, ctl = _setup(nt=3, ns=3, fitness="mu")
    pop.ratings.load_ratings([("t0", [30.0, 8.0]), ("t1", [25.0, 1.0]), ("t2", [26.0, 1.0]),
                              ("s0", [20.0, 1.0]), ("s1", [21.0, 1.0]), ("s2", [22.0, 1.0])])
    assert {r.victim_id for r in ctl.plan(pop, 10).replacements} == {"t1", "s0"}
    _, pop, ctl = _setup(nt=3, ns=3)  # mu - 3 sigma: t0's huge sigma makes it the weakest
    pop.ratings.load_ratings([("t0", [30.0, 8.0]), ("t1", [25.0, 1.0]), ("t2", [26.0, 1.0]),
                              ("s0", [20.0, 1.0]), ("s1", [21.0, 1.0]), ("s2", [22.0, 1.0])])
    assert {r.victim_id for r in ctl.plan(pop, 10).replacements} == {"t0", "s0"}
    _, pop, ctl = _setup(nt=3, ns=3, fitness="recent_reward")
    rewards = {"t0": 1.0, "t1": -1.0, "t2": 0.0, "s0": 0.5, "s1": 0.2, "s2": 0.9}
    assert {r.victim_id for r in ctl.plan(pop, 10, rewards).replacements} == {"t1", "s1"}
    with pytest.raises(ValueError, match="recent reward"):
        ctl.plan(pop, 10, {"t0": 1.0})


def test_due():
    _, _, ctl = _setup(interval_steps=5)
    assert [s for s in range(16) if ctl.due(s)] == [5, 10, 15]
    _, _, off = _setup(enabled=False)
    assert not off.due(10)


# --- operators, parents, determinism -------------------------------------------------------------------------


def test_crossover_parents_fittest_first_and_kind_mix():
    ops = _fake_ops()
    _, pop, ctl = _setup(nt=8, ns=8, ops=ops, cull_fraction=0.5, crossover_rate=0.5)
    fit = pop.fitness()
    kinds = []
    for step in range(1, 30):
        plan = ctl.plan(pop, step * 10)
        for r in plan.replacements:
            kinds.append(r.kind)
            assert r.operator == ("cross" if r.kind == "crossover" else "mut")
            assert len(r.parent_ids) == (2 if r.kind == "crossover" else 1)
            assert len(set(r.parent_ids)) == len(r.parent_ids)
            assert [fit[p] for p in r.parent_ids] == sorted((fit[p] for p in r.parent_ids), reverse=True)
            assert r.params == {"scale": 1.0} and r.reset_optimizer
    frac = kinds.count("crossover") / len(kinds)
    assert 0.4 < frac < 0.6, frac


def test_operator_probabilities_and_params_pass_through():
    ops = {"m1": FakeOp("m1", "mutation"), "m2": FakeOp("m2", "mutation"), "x": FakeOp("x", "crossover")}
    _, pop, ctl = _setup(nt=8, ns=8, ops=ops, cull_fraction=0.5, crossover_rate=0.0,
                         operators={"m1": 3.0, "m2": 1.0, "x": 1.0}, operator_params={"m2": {"scale": 0.5}})
    names = [r.operator for s in range(20) for r in ctl.plan(pop, 10).replacements]
    assert set(names) <= {"m1", "m2"} and 0.65 < names.count("m1") / len(names) < 0.85
    m2 = [r for s in range(5) for r in ctl.plan(pop, 10).replacements if r.operator == "m2"]
    assert m2 and all(r.params == {"scale": 0.5} for r in m2)


def test_small_subpopulation_only_mutates():
    _, pop, ctl = _setup(nt=2, ns=2, crossover_rate=0.9)
    for _ in range(10):
        plan = ctl.plan(pop, 10)
        assert [r.kind for r in plan.replacements] == ["mutation", "mutation"]
        assert [r.parent_ids for r in plan.replacements] == [("t1",), ("s1",)]


def test_plan_deterministic_and_rng_state_roundtrip():
    _, pop, a = _setup(nt=5, ns=5, cull_fraction=0.5)
    _, _, b = _setup(nt=5, ns=5, cull_fraction=0.5)
    assert a.plan(pop, 10) == b.plan(pop, 10)
    state = a.state_dict()
    nxt = [a.plan(pop, 20) for _ in range(3)]
    _, _, c = _setup(nt=5, ns=5, cull_fraction=0.5)
    c.load_state_dict(state)
    assert [c.plan(pop, 20) for _ in range(3)] == nxt
    assert nxt[0] != nxt[1] or nxt[1] != nxt[2]  # the RNG does move


# --- apply ------------------------------------------------------------------------------------------------------


def test_apply_lineage_slots_and_fresh_ratings():
    _, pop, ctl = _setup(nt=4, ns=4, crossover_rate=1.0, cull_fraction=0.5)
    adapters = {m.id: _adapter(i) for i, m in enumerate(pop.members)}
    plan = ctl.plan(pop, 10)
    assert len(plan) == 4 and all(r.kind == "crossover" for r in plan.replacements)
    children = ctl.apply(plan, pop, adapters)
    assert set(children) == {"t4", "t5", "s4", "s5"}
    for r in plan.replacements:
        child, victim = pop.member(r.child_id), pop.member(r.victim_id)
        assert child.parents == r.parent_ids and len(child.parents) == 2  # both parents in the lineage
        assert child.operator == "cross" and child.birth_step == 10 and child.generation == 1
        assert child.slot == victim.slot == r.victim_slot
        assert victim.death_step == 10 and not victim.alive and r.victim_id not in pop.ratings
        assert pop.ratings.mu(r.child_id) == 25.0 and pop.ratings.sigma(r.child_id) == pytest.approx(25 / 3)
        assert list(children[r.child_id]) == list(adapters[r.parent_ids[0]])
    assert sorted(m.slot for m in pop.members) == list(range(8))
    with pytest.raises(ValueError, match="stale plan"):
        ctl.apply(plan, pop, {**adapters, **children})


def test_apply_inherit_inflate_sigma():
    _, pop, ctl = _setup(nt=3, ns=3, child_rating="inherit_inflate_sigma", crossover_rate=0.0)
    pop.ratings.load_ratings([("t0", [20.0, 2.0]), ("t1", [30.0, 3.0]), ("t2", [40.0, 6.0]),
                              ("s0", [20.0, 1.0]), ("s1", [21.0, 1.0]), ("s2", [22.0, 1.0])])
    adapters = {m.id: _adapter(i) for i, m in enumerate(pop.members)}
    plan = ctl.plan(pop, 10)
    ctl.apply(plan, pop, adapters)
    for r in plan.replacements:
        parent = r.parent_ids[0]
        mu, sigma = {"t1": (30.0, 6.0), "t2": (40.0, 25 / 3), "s1": (21.0, 2.0), "s2": (22.0, 2.0)}[parent]
        assert pop.ratings.mu(r.child_id) == mu and pop.ratings.sigma(r.child_id) == pytest.approx(sigma)


def test_apply_with_real_operators_never_modifies_parents():
    from populora_verl.evolution.operators import OPERATORS

    cfg = load_config({"population": {"num_teachers": 3, "num_students": 3}})
    pop = Population.create(cfg)
    adapters = {m.id: _adapter(i) for i, m in enumerate(pop.members)}
    # B = 0 for one member, as PEFT initialises it.
    adapters["t1"] = {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in adapters["t1"].items()}
    snapshot = {mid: {k: v.clone() for k, v in sd.items()} for mid, sd in adapters.items()}
    for step, name in enumerate(sorted(OPERATORS), start=1):
        ctl = PBTController(load_config({"population": {"num_teachers": 3, "num_students": 3},
                                         "pbt": {"operators": {name: 1.0}, "min_age": 0,
                                                 "crossover_rate": 1.0 if OPERATORS[name].kind == "crossover" else 0.0}}).pbt,
                            seed=step)
        plan = ctl.plan(pop, step)
        assert {r.operator for r in plan.replacements} == {name}
        children = ctl.apply(plan, pop, adapters)
        for mid, sd in snapshot.items():
            for k, v in sd.items():
                assert torch.equal(adapters[mid][k], v), (name, mid, k)
        for cid, child in children.items():
            assert all(torch.isfinite(t).all() for t in child.values())
        # The children join the bank (in their victims' slots); the dead leave it.
        for r in plan.replacements:
            adapters.pop(r.victim_id)
            adapters[r.child_id] = children[r.child_id]
            snapshot.pop(r.victim_id)
            snapshot[r.child_id] = {k: v.clone() for k, v in children[r.child_id].items()}
    assert len(pop.lineage) == 6 + 2 * len(OPERATORS)


def test_apply_is_reproducible_from_the_plan():
    _, pop_a, ctl = _setup(nt=3, ns=3)
    _, pop_b, _ = _setup(nt=3, ns=3)
    adapters = {m.id: _adapter(i) for i, m in enumerate(pop_a.members)}
    plan = ctl.plan(pop_a, 10)
    a = ctl.apply(plan, pop_a, adapters)
    b = ctl.apply(plan, pop_b, adapters)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[c][k], b[c][k]) for c in a for k in a[c])


def test_plan_to_dict_is_json():
    import json

    _, pop, ctl = _setup()
    plan = ctl.plan(pop, 10)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["step"] == 10 and len(d["replacements"]) == len(plan) and isinstance(plan, EvolutionPlan)


def test_single_agent_does_not_evolve():
    cfg = load_config({"population": {"mode": "single_agent"}, "pbt": {"enabled": True}})
    assert cfg.pbt.enabled is False
    ctl = PBTController(cfg.pbt, seed=0, operators=_fake_ops())
    ctl.validate(cfg.population)
    assert not ctl.due(10)
    plan = ctl.plan(Population.create(cfg), 10)
    assert plan.replacements == [] and len(plan.notes) == 2


# --- config errors ----------------------------------------------------------------------------------------------


def _error(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_config_errors_name_the_key():
    ops = _fake_ops()
    cfg = load_config({"pbt": {"operators": {"mut": 1.0, "nope": 1.0}}})
    assert _error(lambda: PBTController(cfg.pbt, operators=ops)).startswith("populora.pbt.operators.nope:")
    cfg = load_config({"pbt": {"operator_params": {"mut": {"scale": 2.0, "eps": 0.1}}}})
    assert _error(lambda: PBTController(cfg.pbt, operators=ops)).startswith("populora.pbt.operator_params.mut.eps:")
    cfg = load_config({"pbt": {"operator_params": {"nope": {}}}})
    assert _error(lambda: PBTController(cfg.pbt, operators=ops)).startswith("populora.pbt.operator_params.nope:")
    assert _error(lambda: load_config({"pbt": {"cull_fraction": 1.5}})).startswith("populora.pbt.cull_fraction:")

    for nt in (1, 2):
        cfg = load_config({"population": {"num_teachers": nt, "num_students": 4}, "pbt": {"crossover_rate": 1.0}})
        ctl = PBTController(cfg.pbt, operators=ops)
        assert _error(lambda: ctl.validate(cfg.population)).startswith("populora.pbt.crossover_rate:")
    cfg = load_config({"population": {"num_teachers": 3, "num_students": 3}, "pbt": {"crossover_rate": 1.0}})
    PBTController(cfg.pbt, operators=ops).validate(cfg.population)  # 3 members leave 2 survivors: fine
    cfg = load_config({"population": {"num_teachers": 4, "num_students": 4},
                       "pbt": {"crossover_rate": 1.0, "cull_fraction": 0.75}})
    ctl = PBTController(cfg.pbt, operators=ops)
    assert _error(lambda: ctl.validate(cfg.population)).startswith("populora.pbt.crossover_rate:")
    # Only crossovers configured, but a sub-population of 2 has a single survivor: it needs a mutation.
    cfg = load_config({"population": {"num_teachers": 2, "num_students": 4}, "pbt": {"operators": {"cross": 1.0}}})
    ctl = PBTController(cfg.pbt, operators=ops)
    assert _error(lambda: ctl.validate(cfg.population)).startswith("populora.pbt.operators:")


def test_config_errors_with_real_registry():
    cfg = load_config({"pbt": {"operators": {"svd_mutaton": 1.0}}})
    assert _error(lambda: PBTController(cfg.pbt)).startswith("populora.pbt.operators.svd_mutaton:")
    cfg = load_config({"pbt": {"operator_params": {"dare_crossover": {"rho": 0.1}}}})
    assert _error(lambda: PBTController(cfg.pbt)).startswith("populora.pbt.operator_params.dare_crossover.rho:")
    cfg = load_config({"pbt": {"operator_params": {"dare_crossover": {"p": 0.5}}}})
    PBTController(cfg.pbt).validate(cfg.population)


def test_apply_shields_parents_from_an_in_place_operator():
    class InPlace(FakeOp):
        def __call__(self, parents, *, generator, scale=1.0):
            for p in parents:
                for v in p.values():
                    v.mul_(0)  # a buggy operator writing into its inputs
            return {k: v.clone() for k, v in parents[0].items()}

    ops = {"mut": InPlace("mut", "mutation")}
    _, pop, ctl = _setup(nt=3, ns=3, ops=ops, operators={"mut": 1.0})
    adapters = {m.id: _adapter(i) for i, m in enumerate(pop.members)}
    snapshot = {mid: {k: v.clone() for k, v in sd.items()} for mid, sd in adapters.items()}
    ctl.apply(ctl.plan(pop, 10), pop, adapters)
    assert all(torch.equal(adapters[m][k], snapshot[m][k]) for m in snapshot for k in snapshot[m])


def test_apply_rejects_an_operator_that_changes_shapes():
    class Bad(FakeOp):
        def __call__(self, parents, *, generator, scale=1.0):
            return {k: v[:1] for k, v in parents[0].items()}

    _, pop, ctl = _setup(nt=3, ns=3, ops={"mut": Bad("mut", "mutation")}, operators={"mut": 1.0})
    adapters = {m.id: _adapter(i) for i, m in enumerate(pop.members)}
    before = pop.ids()
    with pytest.raises(RuntimeError, match="shapes"):
        ctl.apply(ctl.plan(pop, 10), pop, adapters)
    assert pop.ids() == before  # the population is untouched when an operator fails
