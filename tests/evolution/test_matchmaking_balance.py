"""Matchmaking feeds every student every step: each student meets ⌊T·k / S⌋ or ⌈T·k / S⌉ teachers whatever the
pool cycle, births and deaths, while PFSP still chooses who meets whom."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from populora_verl.config import load_config
from populora_verl.population import Matchmaker, Population

METHODS = ["pfsp_trueskill", "uniform", "round_robin"]


def _evolve(pop: Population, step: int, rng: np.random.Generator) -> None:
    """A PBT event without adapters: the weakest member of each role dies, a child of a random other one (or of
    itself, alone in its role) takes its slot."""
    for role in ("teacher", "student"):
        ids = [m.id for m in pop.role_members(role)]
        victim = min(ids, key=pop.ratings.conservative)
        others = [i for i in ids if i != victim] or [victim]
        parent = others[int(rng.integers(len(others)))]
        pop.replace(victim, pop.next_id(role), [parent], "neftune", step)


def _run(teachers: int, students: int, *, seed: int, steps: int, evolve_at=(), k: int = 1,
         method: str = "pfsp_trueskill", rate: bool = True):
    """Yields ``(population, pairs)`` of each step; matches are rated with random solve rates (PFSP weights move)
    and the population evolves after each step in ``evolve_at``."""
    cfg = load_config({"population": {"num_teachers": teachers, "num_students": students},
                       "matchmaking": {"method": method, "students_per_problem": k}})
    pop, mm = Population.create(cfg), Matchmaker(cfg.matchmaking, seed=seed)
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        pairs = mm.pairs(pop, step)
        yield pop, pairs
        if rate:
            for t, s in pairs:
                pop.ratings.rate_match(t, s, list(rng.random(2)))
        pop.step = step
        pop.tick()
        if step in evolve_at:
            _evolve(pop, step, rng)


def _assert_balanced(pop: Population, pairs: list[tuple[str, str]], k: int) -> None:
    teachers, students = [m.id for m in pop.teachers()], [m.id for m in pop.students()]
    k = min(k, len(students))
    by_teacher: dict[str, list[str]] = {}
    for t, s in pairs:
        by_teacher.setdefault(t, []).append(s)
    assert sorted(by_teacher) == sorted(teachers)
    assert all(len(set(ss)) == len(ss) == k for ss in by_teacher.values()), by_teacher
    met = Counter(s for _, s in pairs)
    base, extra = divmod(len(teachers) * k, len(students))
    assert set(met) <= set(students)
    counts = sorted(met.get(s, 0) for s in students)
    assert counts == [base] * (len(students) - extra) + [base + 1] * extra, (pop.step, met)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", range(1, 9))
def test_every_student_meets_one_teacher_every_step_through_evolution(n, method):
    """nTnS, 1 ≤ n ≤ 8: every student is fed by exactly one teacher on every step, also right after a newborn
    joins (evolution every 3 steps, so births fall in the middle of a pool cycle of every length)."""
    for seed in range(4):
        for pop, pairs in _run(n, n, seed=seed, steps=30, evolve_at=range(3, 30, 3), method=method):
            _assert_balanced(pop, pairs, 1)
            assert sorted(s for _, s in pairs) == sorted(m.id for m in pop.students())


def test_a_newborn_student_does_not_take_a_teacher_from_its_sibling():
    """The failure real runs showed: after a student was replaced, one student met both teachers and the other
    none, alternating, for the rest of the run."""
    cfg = load_config({"population": {"num_teachers": 2, "num_students": 2}})
    for seed in range(10):
        pop, mm = Population.create(cfg), Matchmaker(cfg.matchmaking, seed=seed)
        mm.pairs(pop, 1)
        pop.replace("s0", "s2", ["s1"], "neftune", 1)
        for step in range(2, 22):
            assert sorted(s for _, s in mm.pairs(pop, step)) == ["s1", "s2"], (seed, step)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_uneven_sizes_share_matches_within_one_every_step_and_evenly_over_a_cycle(k):
    """Every T, S in 1..8: per step each student meets ⌊T·k/S⌋ or ⌈T·k/S⌉ teachers (k distinct students per
    teacher); without evolution no student is ever more than one match ahead of another in total."""
    for t in range(1, 9):
        for s in range(1, 9):
            total = Counter()
            for pop, pairs in _run(t, s, seed=t * 10 + s, steps=2 * s + 1, k=k, method="uniform", rate=False):
                _assert_balanced(pop, pairs, k)
                total.update(x for _, x in pairs)
                got = [total.get(m.id, 0) for m in pop.students()]
                assert max(got) - min(got) <= 1, (t, s, k, total)


@pytest.mark.parametrize("method", ["pfsp_trueskill", "round_robin"])
def test_uneven_sizes_stay_balanced_when_evolution_lands_mid_cycle(method):
    """2T3S, 3T5S, 5T3S, 2T7S with k = 1 and 2: a cycle of extras spans several steps; births inside it change
    nothing about the per-step shares."""
    for t, s in ((2, 3), (3, 5), (5, 3), (2, 7)):
        for k in (1, 2):
            for seed in range(3):
                for pop, pairs in _run(t, s, seed=seed, steps=24, evolve_at=(2, 5, 7, 11, 13, 17), k=k,
                                       method=method):
                    _assert_balanced(pop, pairs, k)


def test_pfsp_still_chooses_who_meets_whom():
    """4T4S where each teacher has one balanced student and three lopsided ones: the balanced pairs dominate under
    PFSP (the last teachers of a step take what is left, so not always), a quarter of the pairs under uniform."""
    share = {}
    for method in ("pfsp_trueskill", "uniform"):
        cfg = load_config({"population": {"num_teachers": 4, "num_students": 4}, "matchmaking": {"method": method}})
        pop = Population.create(cfg)
        pop.ratings.load_ratings({**{f"t{i}": [10.0 + 12 * i, 1.0] for i in range(4)},
                                  **{f"s{i}": [10.0 + 12 * i, 1.0] for i in range(4)}}.items())
        mm = Matchmaker(cfg.matchmaking, seed=0)
        counts = Counter(p for step in range(200) for p in mm.pairs(pop, step))
        share[method] = sum(counts[(f"t{i}", f"s{i}")] for i in range(4)) / (4 * 200)
    assert share["pfsp_trueskill"] > 0.75 and 0.15 < share["uniform"] < 0.35, share


def test_the_pool_state_round_trips_mid_cycle():
    """Saved between two steps of a cycle of extras (2T3S), a copy continues with the same pairs."""
    cfg = load_config({"population": {"num_teachers": 2, "num_students": 3}})
    pop = Population.create(cfg)
    a = Matchmaker(cfg.matchmaking, seed=5)
    a.pairs(pop, 1)
    b = Matchmaker(cfg.matchmaking, seed=0)
    b.load_state_dict(a.state_dict())
    assert [a.pairs(pop, s) for s in range(2, 9)] == [b.pairs(pop, s) for s in range(2, 9)]
