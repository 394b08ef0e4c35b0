"""An evolution event where the slots live (apply_evolution_plan), in both layouts, on CPU stand-ins for a 7B's LoRA
factors: its seconds per phase, and the children it makes against the driver's way of making them."""

from __future__ import annotations

import time

import pytest
import torch

from populora_verl.bench import evolution_event as bench
from populora_verl.bench.operators import ModelShape
from populora_verl.workers.adapter_bank import EVOLUTION_PHASES

SMALL = ModelShape(layers=2, hidden=16, intermediate=24, kv_out=8)
LAYOUTS = ["bank", "resident"]


def _states(store):
    return [store.get_adapter_state(k) for k in range(store.num_slots)]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_phase_is_timed_and_the_phases_add_up_to_no_more_than_the_event(layout):
    store = bench.make_store(layout, SMALL, rank=4, num_slots=6)
    timing = {}
    t0 = time.perf_counter()
    assert store.apply_plan(bench.event_plan(6), timing=timing) == [4, 5]
    total = time.perf_counter() - t0
    assert list(timing) == list(EVOLUTION_PHASES) == ["operator", "gather", "scatter", "optimizer"]
    assert all(isinstance(v, float) and v >= 0 for v in timing.values())
    assert sum(timing.values()) <= total
    assert store.apply_plan([]) == []  # no timing asked: nothing to fill


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_workers_make_the_children_the_driver_made(layout):
    """The same plan through the trainer's former path (full CPU parents to the driver, the operator there, the
    child back into its slot) and through apply_evolution_plan: the same weights and optimizer states, bit for bit."""
    driver, workers = (bench.make_store(layout, SMALL, rank=4, num_slots=6) for _ in range(2))
    plan = bench.event_plan(6)
    bench.run_driver(driver, plan, ranks=2)
    bench.run_workers(workers, plan)
    for k, (a, b) in enumerate(zip(_states(driver), _states(workers))):
        assert _same(a, b), f"slot {k}"
        assert driver.slot_info(k) == workers.slot_info(k)
    assert workers.slot_info(4)["optimizer_step"] == 0 and workers.slot_info(5)["optimizer_step"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_gather_for_evolution_is_a_copy_of_the_slot(layout):
    store = bench.make_store(layout, SMALL, rank=4, num_slots=5)
    on_cpu, here = store.get_adapter_state(1), store.get_adapter_state(1, to_cpu=False)
    assert _same(on_cpu, here)
    for t in here.values():
        t.add_(1.0)  # an operator that wrote into its parents would not reach the slot
    assert _same(store.get_adapter_state(1), on_cpu)


def test_a_child_keeping_its_parents_optimizer_reuses_the_victims_buffers():
    store = bench.make_store("bank", SMALL, rank=4, num_slots=5)
    buffers = {n: {k: v for k, v in st.items() if torch.is_tensor(v)} for n, st in store._slots[4].optim.items()}
    store.copy_optimizer(1, 4)
    for n, st in store._slots[4].optim.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert v is buffers[n][k] and torch.equal(v, store._slots[1].optim[n][k])
                assert v is not store._slots[1].optim[n][k]


def test_a_parent_that_a_later_child_replaces_gives_its_pre_event_weights():
    store = bench.make_store("bank", SMALL, rank=4, num_slots=5)
    pre = _states(store)
    ops = {"copy": lambda parents, generator: {k: v.clone() for k, v in parents[0].items()}}
    # slot 1 is read by the second entry and replaced by the first: the first child's write waits for the read
    store.apply_plan([{"child_slot": 1, "operator": "copy", "parent_slots": [0], "seed": 0},
                      {"child_slot": 2, "operator": "copy", "parent_slots": [1], "seed": 0}], operators=ops)
    assert _same(store.get_adapter_state(1), pre[0]) and _same(store.get_adapter_state(2), pre[1])

