"""AdapterBank on a tiny PEFT Qwen2: swaps are exact and each slot trains as if it had its own optimizer."""

from __future__ import annotations


import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

from populora_verl.workers.adapter_bank import AdapterBank, AdapterBankError, PlanEntry, peft_key  # noqa: E402

LR = 1e-2


def tiny_peft_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora)


def make_opt(model):
    # verl builds its optimizer over module.parameters(): frozen base params included (they never get grads).
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))  # warmup: per-slot schedule
    return opt, sched


def batch(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, 12), generator=g)


def train_step(model, opt, sched, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def live_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture()
def setup():
    model = tiny_peft_model()
    opt, sched = make_opt(model)
    bank = AdapterBank(model, opt, sched, pin_memory=False)
    bank.init_slots(3, seed=7)
    return model, opt, sched, bank


def test_keys_are_peft_keys(setup):
    model, _, _, bank = setup
    assert sorted(bank.peft_keys) == sorted(get_peft_model_state_dict(model).keys())
    assert peft_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    # Fresh slots differ (different lora_A), all start with lora_B = 0 (the base policy).
    s0, s1 = bank.get_adapter_state(0), bank.get_adapter_state(1)
    a_keys = [k for k in s0 if "lora_A" in k]
    assert all(not torch.equal(s0[k], s1[k]) for k in a_keys)
    assert all(torch.count_nonzero(s0[k]) == 0 for k in s0 if "lora_B" in k)


def test_swap_round_trip_bit_exact(setup):
    model, _, _, bank = setup
    before = {k: bank.get_adapter_state(k) for k in range(3)}
    for k in (1, 0, 2, 1):
        bank.swap_in(k, train=False)
        assert_same(live_state(model), before[k])
    # Swapping in with train=True and out without changes keeps everything bit-identical.
    for k in (2, 0):
        with bank.active(k):
            pass
    for k in range(3):
        assert_same(bank.get_adapter_state(k), before[k])


def test_untouched_slots_bit_identical_after_training_another(setup):
    model, opt, sched, bank = setup
    before = {k: bank.get_adapter_state(k) for k in range(3)}
    info_before = bank.slot_info(2)
    for i in range(3):
        with bank.active(1):
            train_step(model, opt, sched, batch(i))
    after1 = bank.get_adapter_state(1)
    assert any(not torch.equal(after1[k], before[1][k]) for k in after1), "slot 1 did not train"
    assert_same(bank.get_adapter_state(0), before[0])
    assert_same(bank.get_adapter_state(2), before[2])
    assert bank.slot_info(2) == info_before


def test_per_slot_adam_step_counts(setup):
    model, opt, sched, bank = setup
    for k, n in ((0, 3), (1, 1), (0, 0)):
        for i in range(n):
            with bank.active(k):
                train_step(model, opt, sched, batch(10 * k + i))
    assert bank.slot_info(0)["optimizer_step"] == 3
    assert bank.slot_info(1)["optimizer_step"] == 1
    assert bank.slot_info(2)["optimizer_step"] == 0
    assert bank.slot_info(0)["updates"] == 3
    # The live optimizer carries exactly the active slot's state.
    bank.swap_in(1, train=False)
    steps = {float(opt.state[p]["step"]) for p in model.parameters() if p.requires_grad}
    assert steps == {1.0}
    bank.swap_in(2, train=False)
    assert all(p not in opt.state or not opt.state[p] for p in model.parameters() if p.requires_grad)


def test_interleaved_training_equals_standalone_copies(setup):
    """The strongest check: slot k trained inside the bank == a private model+optimizer trained alone."""
    model, opt, sched, bank = setup
    standalone = {}
    for k in range(3):
        m = tiny_peft_model()
        set_peft_model_state_dict(m, bank.get_adapter_state(k))
        standalone[k] = (m, *make_opt(m))
    schedule = [0, 1, 0, 2, 1, 0, 0, 2, 1]
    for i, k in enumerate(schedule):
        with bank.active(k):
            train_step(model, opt, sched, batch(i))
        m, o, s = standalone[k]
        train_step(m, o, s, batch(i))
    for k in range(3):
        assert_same(bank.get_adapter_state(k), live_state(standalone[k][0]))
        # Per-slot LR schedule: the slot's live LR equals its standalone scheduler's.
        bank.swap_in(k, train=False)
        assert opt.param_groups[0]["lr"] == standalone[k][1].param_groups[0]["lr"]


def test_save_load_round_trip(setup, tmp_path):
    model, opt, sched, bank = setup
    for i, k in enumerate([0, 1, 1, 2]):
        with bank.active(k):
            train_step(model, opt, sched, batch(i))
    path = tmp_path / "bank_world_size_1_rank_0.pt"
    bank.save(str(path))

    model2 = tiny_peft_model(seed=123)  # different base init is irrelevant: only the adapter is banked
    set_peft_model_state_dict(model2, get_peft_model_state_dict(model))
    model2.load_state_dict(model.state_dict())
    opt2, sched2 = make_opt(model2)
    bank2 = AdapterBank(model2, opt2, sched2, pin_memory=False)
    bank2.load(str(path))
    assert bank2.num_slots == 3 and bank2.active_slot is None
    for k in range(3):
        assert_same(bank2.get_adapter_state(k), bank.get_adapter_state(k))
        assert bank2.slot_info(k) == bank.slot_info(k)
    # Training continues identically from the restored optimizer state.
    for b, (m, o, s) in ((bank, (model, opt, sched)), (bank2, (model2, opt2, sched2))):
        with b.active(1):
            train_step(m, o, s, batch(99))
    assert_same(bank2.get_adapter_state(1), bank.get_adapter_state(1))


def test_load_puts_accelerator_state_on_this_ranks_device(setup, tmp_path):
    """A bank saved by a rank whose optimizer step lived on cuda:3 loads where this rank's parameters live."""
    model, opt, sched, bank = setup
    with bank.active(0):
        train_step(model, opt, sched, batch(0))
    state = bank.state_dict()
    for st in state["slots"][0]["optim"].values():
        st["step"] = st["step"].reshape(())  # step kept as a 0-d tensor, as fused/capturable AdamW does
        st["__device__step"] = "cuda:3"
    bank.load_state_dict(state)
    for k in (0, 0):  # slot 0 loaded into the live optimizer (and again: the buffer is reused)
        bank.swap_in(1)
        bank.swap_in(k)
    steps = [opt.state[p]["step"] for p in bank._params.values()]
    assert all(s.device.type == "cpu" and float(s) == 1.0 for s in steps)


def test_load_rejects_other_model(setup, tmp_path):
    _, _, _, bank = setup
    path = tmp_path / "b.pt"
    bank.save(str(path))
    other = get_peft_model(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)), LoraConfig(r=4, target_modules=["q_proj"]))
    b = AdapterBank(other, pin_memory=False)
    with pytest.raises(AdapterBankError, match="different adapter parameters"):
        b.load(str(path))


def test_set_adapter_state_validates_and_bumps_version(setup):
    model, opt, sched, bank = setup
    sd = bank.get_adapter_state(0)
    with bank.active(1):
        train_step(model, opt, sched, batch(0))
    assert bank.version(1) == 0
    bank.set_adapter_state(1, sd, reset_optimizer=True)
    assert bank.version(1) == 1
    assert_same(bank.get_adapter_state(1), sd)
    assert bank.slot_info(1)["optimizer_step"] == 0
    # The live adapter held slot 1's old weights: the next swap-in must load the new ones.
    bank.swap_in(1, train=False)
    assert_same(live_state(model), sd)
    bad = dict(sd)
    bad.pop(next(iter(bad)))
    with pytest.raises(AdapterBankError, match="missing"):
        bank.set_adapter_state(2, bad)
    wrong = {k: v.T.contiguous() if "lora_A" in k else v for k, v in sd.items()}
    with pytest.raises(AdapterBankError, match="shape"):
        bank.set_adapter_state(2, wrong)
    with pytest.raises(AdapterBankError, match="out of range"):
        bank.swap_in(3)


def test_reset_optimizer(setup):
    model, opt, sched, bank = setup
    with bank.active(0):
        train_step(model, opt, sched, batch(0))
    assert bank.slot_info(0)["optimizer_step"] == 1
    bank.reset_optimizer(0)
    assert bank.slot_info(0)["optimizer_step"] == 0
    bank.swap_in(1, train=False)
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / 3)  # another slot keeps its place in the schedule


class _Avg:
    name, kind, num_parents, defaults = "avg", "crossover", 2, {}

    def __call__(self, parents, *, generator, w=0.5):
        return {k: w * parents[0][k] + (1 - w) * parents[1][k] for k in parents[0]}


class _Noise:
    name, kind, num_parents, defaults = "noise", "mutation", 1, {}

    def __call__(self, parents, *, generator, scale=0.1):
        return {k: v + scale * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in parents[0].items()}


def test_apply_plan_writes_children_from_pre_plan_parents(setup):
    model, opt, sched, bank = setup
    with bank.active(0):
        train_step(model, opt, sched, batch(0))
    pre = {k: bank.get_adapter_state(k) for k in range(3)}
    ops = {"avg": _Avg(), "noise": _Noise()}
    # Slot 1 is a parent of the first child and the victim of the second: the first child uses its old weights.
    plan = [PlanEntry(child_slot=2, operator="avg", parent_slots=[0, 1], seed=3, params={"w": 0.25}),
            {"child_slot": 1, "operator": "noise", "parent_slots": [0], "seed": 4}]
    assert bank.apply_plan(plan, operators=ops) == [2, 1]
    assert_same(bank.get_adapter_state(2), _Avg()([pre[0], pre[1]], generator=None, w=0.25))
    assert_same(bank.get_adapter_state(1), _Noise()([pre[0]], generator=torch.Generator().manual_seed(4)))
    assert_same(bank.get_adapter_state(0), pre[0])
    assert [bank.version(k) for k in range(3)] == [0, 1, 1]
    assert bank.slot_info(0)["optimizer_step"] == 1
    with pytest.raises(AdapterBankError, match="unknown operator"):
        bank.apply_plan([PlanEntry(0, "nope", [1], 0)], operators=ops)
    with pytest.raises(AdapterBankError, match="needs 2 parents"):
        bank.apply_plan([PlanEntry(0, "avg", [1], 0)], operators=ops)


def test_apply_plan_with_registered_operators(setup):
    ops_mod = pytest.importorskip("populora_verl.evolution.operators")
    _, _, _, bank = setup
    name = next(n for n, op in ops_mod.OPERATORS.items() if op.num_parents == 1)
    before = bank.get_adapter_state(0)
    bank.apply_plan([PlanEntry(child_slot=2, operator=name, parent_slots=[0], seed=1)])
    child = bank.get_adapter_state(2)
    assert child.keys() == before.keys()
    assert all(child[k].shape == before[k].shape for k in child)
    assert_same(bank.get_adapter_state(0), before)


def test_from_live_and_forward_only(setup):
    model, _, _, _ = setup
    bank = AdapterBank(model, pin_memory=False)  # forward-only: no optimizer
    bank.init_slots(2, from_live=True)
    live = live_state(model)
    assert_same(bank.get_adapter_state(0), live)
    assert_same(bank.get_adapter_state(1), live)
    with pytest.raises(AdapterBankError, match="seed"):
        bank.init_slots(2)
    with pytest.raises(AdapterBankError, match="no LoRA parameters"):
        AdapterBank(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2)))


def test_swaps_are_named_in_a_torch_profile(setup):
    """A profile of the trainer shows each slot's copy in and out as a stage of its own (bench.trace_summary)."""
    _, _, _, bank = setup
    bank.swap_in(2, train=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bank.swap_in(0)  # slot 2 came in read-only: nothing to write back
        bank.swap_in(1)  # writes slot 0 back first
    names = [e.name for e in prof.events()]
    assert names.count("populora_bank_swap_in") == 2 and names.count("populora_bank_swap_out") == 1


def test_a_swap_queues_its_copies_and_waits_once_before_returning(setup, monkeypatch):
    """A swap's copies go out without blocking (one wait per copy made a GPU swap ~1,200 round trips); the swap
    still waits before it returns, since the slot's CPU buffers are read or rewritten next."""
    import populora_verl.workers.adapter_bank as ab

    model, opt, sched, bank = setup
    with bank.active(0):
        train_step(model, opt, sched, batch(0))  # slot 0 has AdamW moments to copy
    bank.swap_in(1, train=False)
    copies, waits = [], []
    real_copy = torch.Tensor.copy_

    def copy_(dst, src, non_blocking=False):
        copies.append(non_blocking)
        return real_copy(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(ab, "_wait_for_copies", lambda: waits.append(copies.count(True)))
    bank.swap_in(0)  # from slot 0's saved state: weights and moments
    n_in = len(copies)
    assert n_in > 0 and all(copies) and waits and waits[-1] == n_in  # it waited after the last copy
    waits.clear()
    bank.swap_out()  # dirty (train=True): written back
    assert len(copies) > n_in and all(copies) and waits == [len(copies)]
