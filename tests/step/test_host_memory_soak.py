"""Host memory that stays flat: what a run keeps across steps on the host must stop growing once the bounded
structures are full.

A run holds, between steps, the population step (population, ratings, matchmaking, task buffers, diagnostics,
lineage), the adapter bank's CPU copies of every slot (weights, AdamW moments, schedules; pinned on a GPU node), the
metrics logger, and the evolution log. This test runs them together for many steps, the way the trainer drives them
(propose, solve, score, one update per slot through the bank, evolution through the shared engine code every step,
a metrics row), on a tiny PEFT model, and measures the bytes those objects hold after each step: Python objects by
``sys.getsizeof`` and tensors by their storages, each counted once. Bytes of objects, not RSS: on a loaded 2-core
machine RSS moves with the allocator and the other processes, while these counts are a function of the run alone.

The bound. Past the warm-up (the task buffers full at ``buffer.max_programs``, every member rated), the growth per
step, fitted by least squares over the remaining steps, must stay below a tenth of the smaller of one slot's bank
state (LoRA weights, AdamW moments, schedule) and one step's requests, responses and samples. Whatever a step leaves
behind per slot or per sample (a CPU copy never freed, a step's responses or rows kept in a list) adds at least one
of those a step, ten times the bound; what legitimately grows (the lineage's record of each evolution event: an event
every step here, a few hundred bytes each; a few counters) stays far under it. The fit over 40 steps averages out a
dict or list that doubles its table now and then. At 7B shapes a slot's state is hundreds of MB, so a leak of one
copy a step alone would break the goal of < 1 GB of host memory per 10 steps.
"""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch

pytest.importorskip("peft")

from populora_verl.diagnostics.metrics import MetricsLogger  # noqa: E402
from populora_verl.step import PopulationStep  # noqa: E402
from populora_verl.step.engine import Phase, evolve  # noqa: E402
from populora_verl.step.records import STUDENT, TEACHER, GenResponse  # noqa: E402
from populora_verl.workers.adapter_bank import AdapterBank  # noqa: E402

from _shared import RIGHT, WRONG, small_step_config  # noqa: E402

STEPS = 40
WARMUP = 15  # the buffers (max_programs 16, two valid programs a step) are full by step 8; margin for ratings
MAX_PROGRAMS = 16

# Objects the walk never enters: code, types and modules are shared with the whole interpreter, not kept by a step.
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType,
         types.FrameType)


def held_bytes(*roots) -> int:
    """Bytes reachable from ``roots``: ``sys.getsizeof`` of every Python object once, plus every tensor storage once
    (by its data pointer: views and shared parameters count one storage)."""
    seen: set[int] = set()
    storages: set[int] = set()
    total = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in storages:
                storages.add(s.data_ptr())
                total += s.nbytes()
            continue
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _tiny_peft():
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)  # as the recipes
    return get_peft_model(transformers.Qwen2ForCausalLM(cfg), lora)


class BankEngine:
    """The trainer's side of a step over an :class:`AdapterBank`: generation by a script, adapters from the bank,
    children written into it with the fitter parent's optimizer state or a fresh one (as the worker does)."""

    def __init__(self, bank: AdapterBank) -> None:
        self.bank = bank

    def generate(self, requests, phase):
        def text(r, k):
            if phase.name == TEACHER:  # a new valid program every step: the buffers keep filling up to their cap
                return (f"plan</think>\n<answer>\n```python\ndef f(x):\n    return x + {phase.step}\n```\n"
                        f"```input\n{k + 1}\n```\n</answer>")
            return RIGHT if k % 2 == 0 else WRONG

        return [GenResponse(r, [text(r, k) for k in range(r.n)], lengths=[5] * r.n) for r in requests]

    def get_adapter(self, slot):
        return self.bank.get_adapter_state(slot)

    def write_child(self, slot, state, optimizer_from):
        self.bank.set_adapter_state(slot, state, reset_optimizer=optimizer_from is None)
        if optimizer_from is not None:
            self.bank.copy_optimizer(optimizer_from, slot)


def _train(model, opt, sched, bank: AdapterBank, slot: int, step: int) -> None:
    """One update of ``slot`` through the bank, with a made-up gradient: what the bank keeps (weights, moments,
    schedule) is what a real update leaves, without a forward pass's cost."""
    g = torch.Generator().manual_seed(step * 10 + slot)
    with bank.active(slot):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _soak(run_dir, executor, leak=None) -> tuple[float, float, list[int]]:
    """Run the soak; ``(growth per step after the warm-up, the bound, bytes held after each step)``. ``leak(bank)``
    runs after each slot's update: a test's way to plant what the soak must catch."""
    cfg = small_step_config(pbt={"interval_steps": 1, "min_age": 0, "final_quiet_steps": 0},
                            buffer={"max_programs": MAX_PROGRAMS})
    ps = PopulationStep(cfg, executor=executor, seed=0)
    ps.set_total_steps(STEPS)
    model = _tiny_peft()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    bank = AdapterBank(model, opt, sched, pin_memory=False)
    bank.init_slots(len(ps.population.members), seed=0)
    engine = BankEngine(bank)
    logger = MetricsLogger(run_dir, tensorboard=False)
    sizes, step_bytes, events = [], [], 0
    try:
        for step in range(1, STEPS + 1):
            proposals = engine.generate(ps.begin(step), Phase(TEACHER, step))
            answers = engine.generate(ps.on_proposals(proposals), Phase(STUDENT, step))
            result = ps.on_answers(answers)
            for m in ps.population.members:
                if result.updates.get(m.id):
                    _train(model, opt, sched, bank, m.slot, step)
                    if leak is not None:
                        leak(bank)
            evolution = evolve(ps, step, engine, run_dir)
            events += bool(evolution.plan and evolution.plan.replacements)
            logger.log({**result.metrics, **evolution.metrics}, step)
            step_bytes.append(held_bytes(proposals, answers, result))
            # no gc.collect(): the walk counts what the roots reach, and garbage is reachable from none of them
            sizes.append(held_bytes(ps, bank, logger))
    finally:
        logger.close()
    assert events >= STEPS // 2, "evolution must run through the soak, or its bookkeeping goes untested"
    assert sum(len(b) for b in ps.tasks.buffers.buffers.values()) <= 3 * MAX_PROGRAMS
    slot_bytes = max(held_bytes(s) for s in bank._slots)  # weights, AdamW moments and schedule of a trained slot
    tail = sizes[WARMUP:]
    xs = range(len(tail))
    mean_x, mean_y = sum(xs) / len(tail), sum(tail) / len(tail)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, tail)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, min(slot_bytes, min(step_bytes)) / 10, sizes


def test_what_a_run_keeps_between_steps_stops_growing(tmp_path, executor):
    slope, bound, sizes = _soak(tmp_path, executor)
    assert slope < bound, (f"what the run keeps grows {slope:.0f} bytes a step after step {WARMUP}, over a tenth of "
                           f"one slot's bank state or of one step's samples ({bound:.0f} bytes); bytes held after "
                           f"each step: {sizes}")


def test_the_soak_catches_a_copy_of_a_slot_kept_per_update(tmp_path, executor):
    """The leak the bank could have: a host copy of the live adapter made on every update and never dropped."""
    def keep_a_copy(bank):
        bank.__dict__.setdefault("_kept", []).append({k: v.clone() for k, v in bank.get_adapter_state(0).items()})

    slope, bound, _ = _soak(tmp_path, executor, leak=keep_a_copy)
    assert slope > 10 * bound
