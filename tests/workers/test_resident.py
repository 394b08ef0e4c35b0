"""Resident adapters against the adapter bank on the same batch: each slot's gradient, its updated weights and its
optimizer state equal what the bank's one-slot-at-a-time path gives (fp32, CPU, the per-slot loop kernel).

The bank path is today's trainer: per slot, swap in, the slot's own token-mean loss, backward, clip by the slot's
norm, AdamW step, scheduler step, swap out. The resident path makes one forward and one backward for every slot's
rows, then one optimizer step over every trained slot."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model  # noqa: E402

import populora_verl.workers.resident as resident  # noqa: E402
from populora_verl.workers.adapter_bank import AdapterBank, AdapterBankError, PlanEntry  # noqa: E402
from populora_verl.workers.resident import (  # noqa: E402
    ResidentAdapters,
    SlotRouting,
    base_only,
    lora_add,
    lora_delta,
    routing,
    slot_token_mean,
)

LR = 1e-2
CLIP = 0.05  # small enough that most slots clip, so per-slot clipping is exercised
SEQ = 10
VOCAB = 96


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora)


def make_opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))  # warmup: per-slot schedules
    return opt, sched


def rows_for(counts: dict[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by slot: ids (B, SEQ), per-token loss mask, per-row advantages, row slots."""
    g = torch.Generator().manual_seed(seed)
    slots = [k for k, c in sorted(counts.items()) for _ in range(c)]
    n = len(slots)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = (torch.rand(n, SEQ - 1, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.randn(n, generator=g)
    return ids, mask, adv, torch.tensor(slots, dtype=torch.long)


def loss_matrix(model, ids, adv) -> torch.Tensor:
    """A policy-gradient loss per token: -A * log p(next token)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -adv[:, None] * logp


def bank_step(model, bank: AdapterBank, opt, sched, ids, mask, adv, slots) -> dict[int, dict[str, torch.Tensor]]:
    """Today's path: one slot at a time. Returns each trained slot's gradients (PEFT keys) before clipping."""
    grads = {}
    for k in sorted(set(slots.tolist())):
        rows = slots == k
        with bank.active(k, train=True):
            lm = loss_matrix(model, ids[rows], adv[rows])
            ((lm * mask[rows]).sum() / mask[rows].sum()).backward()
            grads[k] = {bank._keys[n]: p.grad.detach().clone() for n, p in bank._params.items()}
            torch.nn.utils.clip_grad_norm_(list(bank._params.values()), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return grads


def resident_step(model, res: ResidentAdapters, ids, mask, adv, slots, *, micro: int = 1,
                  perm: torch.Tensor | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """One forward/backward per micro-batch for every slot's rows, then one optimizer step."""
    if perm is not None:  # rows not sorted by slot: the routing permutes tokens
        ids, mask, adv, slots = ids[perm], mask[perm], adv[perm], slots[perm]
    slot_tokens = {int(k): float(mask[slots == k].sum()) for k in slots.unique()}
    for chunk in torch.arange(len(slots)).chunk(micro):
        r = SlotRouting.from_rows(slots[chunk], [SEQ] * len(chunk), res.num_slots)
        with routing(r):
            lm = loss_matrix(model, ids[chunk], adv[chunk])
            slot_token_mean(lm, mask[chunk], slots[chunk], slot_tokens).backward()
    grads = {k: {key: res._slot_param(k, n).grad.detach().clone() for n, key in res._keys.items()}
             for k in slot_tokens}
    res.optimizer_step(CLIP, trained=list(slot_tokens))
    res.advance_schedule()
    return grads


def pair(num_slots: int, seed: int = 3):
    mb, mr = tiny_model(), tiny_model()
    ob, sb = make_opt(mb)
    bank = AdapterBank(mb, ob, sb)
    bank.init_slots(num_slots, seed=seed)
    orr, sr = make_opt(mr)
    res = ResidentAdapters(mr, orr, sr)
    res.init_slots(num_slots, seed=seed)
    return (mb, bank, ob, sb), (mr, res)


def assert_close_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{what} {k}: {m}")


def assert_same_optimizer(bank: AdapterBank, res: ResidentAdapters, slot: int):
    bank.swap_out()
    saved = bank._slots[slot].optim or {}
    for n in bank._params:
        live = res.optimizer.state.get(res._slot_param(slot, n), {})
        if n not in saved:
            assert not live, f"slot {slot} {n}: resident has optimizer state, bank has none"
            continue
        assert float(live["step"]) == float(saved[n]["step"]), f"slot {slot} {n}: step"
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(live[key], saved[n][key], atol=1e-7, rtol=1e-4,
                                       msg=lambda m, key=key, n=n: f"slot {slot} {n} {key}: {m}")


def check_equal(bank_side, res_side, batches: list[dict[int, int]], *, micro: int = 1, shuffle: bool = False):
    mb, bank, ob, sb = bank_side
    mr, res = res_side
    for i, counts in enumerate(batches):
        ids, mask, adv, slots = rows_for(counts, seed=100 + i)
        gb = bank_step(mb, bank, ob, sb, ids, mask, adv, slots)
        perm = torch.randperm(len(slots), generator=torch.Generator().manual_seed(i)) if shuffle else None
        gr = resident_step(mr, res, ids, mask, adv, slots, micro=micro, perm=perm)
        assert gb.keys() == gr.keys()
        for k in gb:
            assert_close_states(gb[k], gr[k], f"step {i} slot {k} gradient")
        for k in range(res.num_slots):
            assert_close_states(bank.get_adapter_state(k), res.get_adapter_state(k), f"step {i} slot {k} weights")
            assert_same_optimizer(bank, res, k)
            assert bank.slot_info(k)["optimizer_step"] == res.slot_info(k)["optimizer_step"]
            assert bank.slot_info(k)["updates"] == res.slot_info(k)["updates"]


@pytest.fixture(params=["loop", "grouped"])
def kernel(request, monkeypatch):
    """Each resident kernel in turn: the per-slot loop (the CPU's default) and torch's grouped matmul (a Hopper
    GPU's), which the CPU runs in fp32 with CUDA's layout rules (:func:`cuda_rules` adds the one it skips)."""
    calls: list = []
    if request.param == "grouped":
        cuda_rules(calls, monkeypatch)
    monkeypatch.setattr(resident, "grouped_mm_available", lambda x: request.param == "grouped")
    yield request.param
    assert bool(calls) == (request.param == "grouped")


def test_founders_are_the_banks_draws():
    (_, bank, _, _), (_, res) = pair(4)
    for k in range(4):
        assert_close_states(bank.get_adapter_state(k), res.get_adapter_state(k), f"slot {k}", atol=0, rtol=0)


def test_single_agent_equals_the_bank():
    bank_side, res_side = pair(1)
    check_equal(bank_side, res_side, [{0: 3}, {0: 2}, {0: 4}])


def test_one_teacher_one_student_equals_the_bank():
    bank_side, res_side = pair(2)
    check_equal(bank_side, res_side, [{0: 1, 1: 4}, {0: 2, 1: 3}, {0: 1, 1: 2}])


def test_four_teachers_four_students_uneven_rows_and_an_idle_slot(kernel):
    bank_side, res_side = pair(8)
    # slot 5 has no rows at step 2 and slot 0 none at step 3: they must take no step at all (AdamW would still decay
    # them and count a step if they stepped with zero gradients)
    check_equal(bank_side, res_side, [
        {k: 1 + (k % 3) for k in range(8)},
        {0: 1, 1: 3, 2: 1, 3: 2, 4: 1, 6: 2, 7: 1},
        {1: 2, 2: 1, 3: 1, 4: 3, 5: 1, 6: 1, 7: 2},
    ])


def test_micro_batches_and_unsorted_rows_give_the_same_update(kernel):
    bank_side, res_side = pair(4)
    check_equal(bank_side, res_side, [{0: 2, 1: 3, 2: 1, 3: 2}, {0: 3, 1: 1, 2: 2, 3: 2}], micro=3, shuffle=True)


def test_an_evolved_child_trains_like_the_banks_child():
    bank_side, res_side = pair(4)
    check_equal(bank_side, res_side, [{0: 2, 1: 2, 2: 1, 3: 2}])
    plan = [PlanEntry(child_slot=3, operator="full_gaussian", parent_slots=[0], seed=7, reset_optimizer=True),
            PlanEntry(child_slot=2, operator="full_gaussian", parent_slots=[1], seed=8, reset_optimizer=False)]
    assert bank_side[1].apply_plan(plan) == res_side[1].apply_plan(plan) == [3, 2]
    for k in range(4):
        assert_close_states(bank_side[1].get_adapter_state(k), res_side[1].get_adapter_state(k), f"child {k}")
        assert bank_side[1].version(k) == res_side[1].version(k)
    assert res_side[1].slot_info(3)["optimizer_step"] == 0  # a fresh optimizer
    assert res_side[1].slot_info(2)["optimizer_step"] == 1  # its parent's
    check_equal(bank_side, res_side, [{0: 1, 1: 2, 2: 2, 3: 1}, {0: 2, 1: 1, 2: 1, 3: 3}])


def test_the_bank_resumes_a_resident_save_and_the_resident_resumes_a_bank_save(tmp_path):
    bank_side, res_side = pair(3)
    check_equal(bank_side, res_side, [{0: 2, 1: 1, 2: 2}, {0: 1, 2: 3}])
    bank_side[1].save(str(tmp_path / "bank.pt"))
    res_side[1].save(str(tmp_path / "resident.pt"))
    # crosswise: a fresh bank from the resident file, fresh resident adapters from the bank file
    mb2, mr2 = tiny_model(), tiny_model()
    ob2, sb2 = make_opt(mb2)
    bank2 = AdapterBank(mb2, ob2, sb2)
    bank2.load(str(tmp_path / "resident.pt"))
    or2, sr2 = make_opt(mr2)
    res2 = ResidentAdapters(mr2, or2, sr2)
    res2.load(str(tmp_path / "bank.pt"))
    for k in range(3):
        assert bank2.slot_info(k) == bank_side[1].slot_info(k)
        assert res2.slot_info(k) == res_side[1].slot_info(k)
        assert res2.learning_rate(k) == res_side[1].learning_rate(k)
    # and both keep training exactly as the originals would
    check_equal((mb2, bank2, ob2, sb2), (mr2, res2), [{0: 1, 1: 2, 2: 1}])


def test_reset_and_copy_optimizer_act_on_slots():
    _, (mr, res) = pair(3)
    ids, mask, adv, slots = rows_for({0: 2, 1: 1, 2: 1}, seed=1)
    resident_step(mr, res, ids, mask, adv, slots)
    res.copy_optimizer(0, 2)
    for p0, p2 in zip(res.slot_parameters(0), res.slot_parameters(2), strict=True):
        torch.testing.assert_close(res.optimizer.state[p0]["exp_avg"], res.optimizer.state[p2]["exp_avg"])
    res.reset_optimizer(1)
    assert res.slot_info(1)["optimizer_step"] == 0 and res.learning_rate(1) == pytest.approx(LR / 3)
    assert res.slot_info(0)["optimizer_step"] == 1 and res.learning_rate(0) == pytest.approx(2 * LR / 3)


def test_without_routing_or_under_base_only_the_model_is_the_base_model():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with model.disable_adapter():
        base = model(input_ids=ids).logits
    res = ResidentAdapters(model, *make_opt(model))
    res.init_slots(2, seed=0)
    for k in range(2):  # give slot weights that change the output
        res.set_adapter_state(k, {key: torch.full_like(v, 0.1 * (k + 1)) for key, v in res.get_adapter_state(k).items()})
    torch.testing.assert_close(model(input_ids=ids).logits, base)
    r = SlotRouting.from_rows([0, 1], [SEQ, SEQ], 2)
    with routing(r):
        routed = model(input_ids=ids).logits
        with base_only():
            torch.testing.assert_close(model(input_ids=ids).logits, base)
    assert not torch.allclose(routed, base)


def test_routing_checks_its_input():
    r = SlotRouting.from_rows([1, 0, 1], [2, 3, 1], 2)
    assert r.counts == (3, 3) and r.perm is not None
    assert SlotRouting.from_rows([0, 0, 1], [2, 3, 1], 2).perm is None
    with pytest.raises(AdapterBankError, match="outside"):
        SlotRouting.from_rows([0, 2], [1, 1], 2)
    with pytest.raises(AdapterBankError, match="row lengths"):
        SlotRouting.from_rows([0, 1], [1], 2)
    a = [torch.randn(2, 4) for _ in range(2)]
    b = [torch.randn(3, 2) for _ in range(2)]
    with pytest.raises(AdapterBankError, match="tokens"):
        lora_delta(torch.randn(5, 4), r, a, b, 1.0)


def test_the_delta_is_each_slots_own_lora_whatever_the_token_order():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(2, 4, generator=g) for _ in range(3)]
    b = [torch.randn(5, 2, generator=g) for _ in range(3)]
    token_slots = torch.tensor([2, 0, 0, 1, 2, 2, 0])
    x = torch.randn(7, 4, generator=g)
    r = SlotRouting.from_tokens(token_slots, 3)
    got = lora_delta(x, r, a, b, 0.5, grouped=False)
    want = torch.stack([0.5 * (b[k] @ (a[k] @ x[t])) for t, k in enumerate(token_slots.tolist())])
    torch.testing.assert_close(got, want)


def test_a_wrong_state_is_refused_in_one_line():
    _, (_, res) = pair(2)
    state = res.get_adapter_state(0)
    key = next(iter(state))
    with pytest.raises(AdapterBankError, match="missing"):
        res.set_adapter_state(0, {k: v for k, v in state.items() if k != key})
    with pytest.raises(AdapterBankError, match="non-finite"):
        res.set_adapter_state(0, {**state, key: torch.full_like(state[key], float("nan"))})
    with pytest.raises(AdapterBankError, match="out of range"):
        res.version(2)


# --- the kernels of one LoRA linear --------------------------------------------------------------------------------


def reference_lora(x, token_slots, a, b, scaling):
    """Token by token: ``scaling * B_k A_k x_t`` for a token of slot ``k``, zero for a token of no slot (``-1``)."""
    rows = [scaling * (b[k] @ (a[k] @ x[t])) if k >= 0 else x.new_zeros(b[0].shape[0])
            for t, k in enumerate(token_slots)]
    return torch.stack(rows)


def leaves(n, shape, g):
    return [torch.randn(*shape, generator=g).requires_grad_() for _ in range(n)]


ROUTINGS = {
    # (row slots, row lengths): one slot; rows grouped by slot in ascending and in any order; rows interleaved
    "one slot": ([1, 1], [3, 2]),
    "grouped ascending": ([0, 0, 1, 2, 2], [2, 1, 3, 2, 1]),
    "grouped any order": ([2, 2, 0, 1], [2, 1, 3, 2]),
    "interleaved": ([1, 0, 2, 0, 1], [2, 3, 1, 2, 2]),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("pad", [0, 3], ids=["no pad", "pad"])
def test_lora_add_gives_each_slot_its_own_lora_and_gradient(name, grouped, pad):
    """Every kernel path of the resident hook (torch's grouped matmul runs fp32 on the CPU) against the formula
    token by token: the output, the input's gradient and each slot's weight gradients; a slot without tokens gets no
    gradient, and a second micro-batch adds to the first's."""
    row_slots, lengths = ROUTINGS[name]
    g = torch.Generator().manual_seed(1)
    a, b = leaves(4, (4, 8), g), leaves(4, (12, 4), g)
    r = SlotRouting.from_rows(row_slots, lengths, 4)
    token_slots = [k for k, n in zip(row_slots, lengths) for _ in range(n)] + [-1] * pad
    x = torch.randn(len(token_slots), 8, generator=g, requires_grad=True)
    base = torch.randn(len(token_slots), 12, generator=g, requires_grad=True)
    upstream = torch.randn(len(token_slots), 12, generator=g)
    got_grads = []
    for _ in range(2):  # two micro-batches: the slot gradients accumulate
        out = lora_add(base, x, r, a, b, 0.5, grouped=grouped)
        out.backward(upstream)
        got_grads.append({id(p): p.grad.clone() for p in a + b if p.grad is not None})
    ref_a = [p.detach().clone().requires_grad_() for p in a]
    ref_b = [p.detach().clone().requires_grad_() for p in b]
    xr, br = x.detach().clone().requires_grad_(), base.detach().clone().requires_grad_()
    want = br + reference_lora(xr, token_slots, ref_a, ref_b, 0.5)
    want.backward(upstream)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(x.grad, 2 * xr.grad)
    torch.testing.assert_close(base.grad, 2 * br.grad)
    present = set(row_slots)
    for k in range(4):
        for p, q in ((a[k], ref_a[k]), (b[k], ref_b[k])):
            if k not in present:
                assert p.grad is None, f"slot {k} has no token but got a gradient"
                continue
            torch.testing.assert_close(got_grads[0][id(p)], q.grad)
            torch.testing.assert_close(p.grad, 2 * q.grad)


def test_rows_grouped_by_slot_in_any_order_need_no_permutation():
    r = SlotRouting.from_rows([2, 2, 0, 1], [2, 1, 3, 2], 3)
    assert r.perm is None and r.inverse is None
    assert r.present == (2, 0, 1) and r.counts == (3, 2, 3) and r.offsets.tolist() == [3, 6, 8]
    tok = SlotRouting.from_tokens(torch.tensor([2, 2, 2, 0, 0, 0, 1, 1]), 3)
    assert tok.perm is None and tok.present == r.present and tok.offsets.tolist() == r.offsets.tolist()
    # rows of one slot split by another slot's rows: the tokens must be permuted
    r = SlotRouting.from_rows([0, 1, 0], [2, 2, 1], 2)
    assert r.perm is not None and r.present == (0, 1) and r.counts == (3, 2)
    # rows without tokens do not split a run
    assert SlotRouting.from_rows([0, 1, 0], [2, 0, 1], 2).perm is None


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_each_slot_the_same_gradient(reentrant, kernel):
    """The recomputed forward must not add a slot's gradient a second time (its weights' backward writes ``.grad``
    itself)."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_model()
        res = ResidentAdapters(model, *make_opt(model))
        res.init_slots(3, seed=5)
        for k in range(3):  # B is zero at init: give every weight a gradient
            res.set_adapter_state(k, {n: v + 0.05 * (k + 1) for n, v in res.get_adapter_state(k).items()})
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.enable_input_require_grads()
        model.train()
        ids, mask, adv, slots = rows_for({0: 2, 2: 1}, seed=4)
        r = SlotRouting.from_rows(slots, [SEQ] * len(slots), 3)
        with routing(r):
            lm = loss_matrix(model, ids, adv)
            slot_token_mean(lm, mask, slots, {0: float(mask[:2].sum()), 2: float(mask[2:].sum())}).backward()
        assert all(p.grad is None for p in res.slot_parameters(1))
        grads.append({k: [p.grad.clone() for p in res.slot_parameters(k)] for k in (0, 2)})
    for k in (0, 2):
        for g0, g1 in zip(grads[0][k], grads[1][k], strict=True):
            torch.testing.assert_close(g1, g0)


def test_slot_token_mean_divides_each_row_by_its_slots_tokens():
    lm = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.float32)
    slots = torch.tensor([3, 0, 3, 1])
    got = slot_token_mean(lm, mask, slots, {3: 10.0, 0: 4.0})  # slot 1 has no count: its rows are summed
    want = (0 + 1) / 10 + 3 / 4 + (6 + 7 + 8) / 10 + (10 + 11)
    assert float(got) == pytest.approx(want)


def test_each_slot_has_its_own_norm_and_a_non_finite_one_skips_only_that_slot():
    import math

    model = tiny_model()
    res = ResidentAdapters(model, *make_opt(model))
    res.init_slots(3, seed=1)
    before = [res.get_adapter_state(k) for k in range(3)]
    for k in range(3):
        for j, p in enumerate(res.slot_parameters(k)):
            p.grad = torch.full_like(p, 0.01 * (k + 1) * (j + 1))
    res.slot_parameters(1)[2].grad[0, 0] = float("nan")
    want = {k: math.sqrt(sum(float(p.grad.square().sum()) for p in res.slot_parameters(k))) for k in (0, 2)}
    norms = res.optimizer_step(CLIP, trained=[0, 1, 2])
    assert norms[0] == pytest.approx(want[0], rel=1e-5) and norms[2] == pytest.approx(want[2], rel=1e-5)
    assert math.isnan(norms[1])
    assert [res.slot_info(k)["updates"] for k in range(3)] == [1, 0, 1]
    after = [res.get_adapter_state(k) for k in range(3)]
    assert all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    assert all(any(not torch.equal(before[k][n], after[k][n]) for n in before[k]) for k in (0, 2))


# --- what torch's grouped matmul takes -----------------------------------------------------------------------------


def cuda_rules(calls: list, monkeypatch) -> None:
    """``torch._grouped_mm`` checking what CUDA checks and the CPU does not all check: the 2-D operand with unit
    stride along rows, its row stride a multiple of 16 bytes, its data 16-byte aligned (the CPU skips this one), and
    the offsets int32 on the operand's device. The kernel's backward calls are torch's own and go unchecked here;
    the CPU refuses the layouts it cannot take there."""
    real = torch._grouped_mm

    def checked(mat_a, mat_b, offs=None, **kw):
        if mat_a.dim() == 2:
            align = 16 // mat_a.element_size()
            assert mat_a.stride(1) == 1 and mat_a.stride(0) >= mat_a.shape[1], (mat_a.shape, mat_a.stride())
            assert mat_a.stride(0) % align == 0, f"row stride {mat_a.stride(0)} is not a multiple of 16 bytes"
            assert mat_a.data_ptr() % 16 == 0, "operand data not 16-byte aligned"
        assert mat_b.data_ptr() % 16 == 0, "weights not 16-byte aligned"
        assert offs is not None and offs.dtype == torch.int32 and offs.device == mat_a.device
        calls.append(tuple(mat_a.shape))
        return real(mat_a, mat_b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", checked)


def layer_input(n: int, width: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """A LoRA linear's input as a model may hand it over: contiguous, every other column of a wider activation, or
    a contiguous view starting one element into its storage (misaligned for the kernel)."""
    if layout == "strided":
        return torch.randn(n, 2 * width, generator=g)[:, ::2]
    if layout == "offset":
        return torch.randn(n * width + 1, generator=g)[1:].view(n, width)
    return torch.randn(n, width, generator=g)


def upstream_gradient(n: int, width: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """The gradient the layer above sends back: contiguous, one row expanded to all (a sum's gradient), or
    column-major (a transpose's)."""
    if layout == "expanded":
        return torch.randn(1, width, generator=g).expand(n, width)
    if layout == "transposed":
        return torch.randn(width, n, generator=g).t()
    return torch.randn(n, width, generator=g)


@pytest.mark.parametrize("name", ["grouped ascending", "grouped any order", "interleaved"])
@pytest.mark.parametrize("x_layout", ["contiguous", "strided", "offset"])
@pytest.mark.parametrize("grad_layout", ["contiguous", "expanded", "transposed"])
@pytest.mark.parametrize("pad", [0, 3], ids=["no pad", "pad"])
def test_grouped_kernel_takes_any_input_and_gradient_layout(name, x_layout, grad_layout, pad, monkeypatch):
    """Rows grouped by slot reach the grouped matmul without a gather, so the layer's input and the gradient of its
    output are the kernel's operands as they come: a layout the kernel refuses must be copied, not passed on."""
    calls: list = []
    cuda_rules(calls, monkeypatch)
    row_slots, lengths = ROUTINGS[name]
    g = torch.Generator().manual_seed(2)
    a, b = leaves(4, (4, 8), g), leaves(4, (12, 4), g)
    r = SlotRouting.from_rows(row_slots, lengths, 4)
    token_slots = [k for k, n in zip(row_slots, lengths) for _ in range(n)] + [-1] * pad
    n = len(token_slots)
    x = layer_input(n, 8, x_layout, g).requires_grad_()
    base = torch.randn(n, 12, generator=g, requires_grad=True)
    upstream = upstream_gradient(n, 12, grad_layout, g)
    out = lora_add(base, x, r, a, b, 0.5, grouped=True)
    out.backward(upstream)
    assert calls, "the grouped kernel did not run"
    ref_a = [p.detach().clone().requires_grad_() for p in a]
    ref_b = [p.detach().clone().requires_grad_() for p in b]
    xr = x.detach().clone().requires_grad_()
    want = base.detach() + reference_lora(xr, token_slots, ref_a, ref_b, 0.5)
    want.backward(upstream)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(x.grad, xr.grad)
    for k in set(row_slots):
        torch.testing.assert_close(a[k].grad, ref_a[k].grad)
        torch.testing.assert_close(b[k].grad, ref_b[k].grad)


def test_widths_the_grouped_kernel_cannot_take_run_the_loop(monkeypatch):
    """On a GPU with the grouped kernel, a linear whose widths are not multiples of 16 bytes (here a rank-4 bf16
    adapter: 8-byte rows of ``x A^T``) takes the per-slot loop instead of failing in the kernel."""
    calls: list = []
    cuda_rules(calls, monkeypatch)
    monkeypatch.setattr(resident, "grouped_mm_available", lambda x: True)  # as on an H100/H200
    row_slots, lengths = ROUTINGS["grouped any order"]
    g = torch.Generator().manual_seed(3)
    a = [t.detach().bfloat16().requires_grad_() for t in leaves(4, (4, 16), g)]
    b = [t.detach().bfloat16().requires_grad_() for t in leaves(4, (16, 4), g)]
    r = SlotRouting.from_rows(row_slots, lengths, 4)
    token_slots = [k for k, n in zip(row_slots, lengths) for _ in range(n)]
    x = torch.randn(len(token_slots), 16, generator=g).bfloat16()
    out = lora_add(torch.zeros(len(token_slots), 16, dtype=torch.bfloat16), x, r, a, b, 0.5)
    out.float().sum().backward()
    assert calls == []
    want = reference_lora(x.float(), token_slots, [t.float() for t in a], [t.float() for t in b], 0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert all(a[k].grad is not None and b[k].grad is not None for k in set(row_slots))
