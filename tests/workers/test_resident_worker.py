"""The worker with resident adapters against the worker with the bank, through the same fused update call.

verl's FSDP engine is GPU-only, so both workers run around a fake engine that follows its contract where the
resident engine attaches: ``forward_backward_batch`` counts the batch's loss tokens into ``batch_num_tokens``, cuts
micro-batches and calls ``forward_step``, which runs the model on the packed rows and calls the loss function with
verl's keywords; ``optimizer_step`` clips by one global norm (verl's), and the scheduler steps once per call. The
bank path runs that once per slot; the resident path once for all slots. Every slot's weights, optimizer state and
schedule must come out the same."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from peft import LoraConfig, get_peft_model  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric.utils import AggregationType, Metric  # noqa: E402

from populora_verl import verl_compat  # noqa: E402
from populora_verl.rollout.lora_registry import split_adapter_tensors  # noqa: E402
from populora_verl.workers.fused import SEGMENTS_KEY, encode_segments  # noqa: E402
from populora_verl.workers.resident import ResidentAdapters  # noqa: E402

from _shared import bare_worker  # noqa: E402

SEQ, VOCAB, CLIP, MICRO_ROWS = 8, 64, 0.05, 3


def tiny_peft():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return get_peft_model(transformers.Qwen2ForCausalLM(cfg),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def pg_loss(model_output, data, dp_group=None):
    """verl's loss contract: a token mean over the mini-batch's ``batch_num_tokens`` (times dp_size)."""
    logp = model_output["log_probs"].values()
    mask = data["loss_mask"].values()
    adv = torch.repeat_interleave(data["advantages"], data["loss_mask"].offsets().diff())
    loss = -(adv * logp * mask).sum() / tu.get_non_tensor_data(data, "batch_num_tokens", None)
    return loss, {"actor/pg_loss": Metric(AggregationType.SUM, loss.detach())}  # as verl's ppo_loss reports it


class FakeEngine:
    """verl's FSDP engine where the resident mixin attaches (one process, no FSDP)."""

    is_param_offload_enabled = False

    def __init__(self):
        self.module = tiny_peft()
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2, weight_decay=0.01)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 5))
        self.optimizer_config = types.SimpleNamespace(clip_grad=CLIP)

    def get_data_parallel_group(self):
        return None

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        tu.assign_non_tensor(data, batch_num_tokens=float(data["loss_mask"].values().sum()))
        n = int(data.batch_size[0])
        outs = []
        for start in range(0, n, MICRO_ROWS):
            micro = tu.index_select_tensor_dict(data, list(range(start, min(n, start + MICRO_ROWS))))
            loss, out = self.forward_step(micro, loss_function, forward_only)
            if not forward_only:
                loss.backward()
            outs.append(out)
        return outs

    def forward_step(self, micro_batch, loss_function, forward_only):
        ids = micro_batch["input_ids"]
        rows = ids.values().reshape(-1, SEQ)  # equal lengths: the packed tokens are the rows one after another
        logits = self.module(input_ids=rows).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.roll(rows, -1, 1)[..., None]).squeeze(-1)
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(logp.reshape(-1), ids.offsets())}
        loss, metrics = loss_function(model_output=out, data=micro_batch, dp_group=None)
        return loss, {"metrics": metrics}

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], CLIP)
        self.optimizer.step()
        return float(norm)

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    def disable_adapter(self):
        return self.module.disable_adapter()

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False):
        return iter([("base.weight", torch.zeros(1))]), {"r": 4}

    def to(self, *a, **k):
        pass


class FakeTrainingWorker:
    def __init__(self):
        self.engine = FakeEngine()

    def train_mini_batch(self, data):
        e = self.engine
        e.optimizer_zero_grad()
        outs = e.forward_backward_batch(data, pg_loss)
        grad_norm = e.optimizer_step()
        lr = e.lr_scheduler_step()
        metrics = {"actor/pg_loss": [float(o["metrics"]["actor/pg_loss"].aggregate()) for o in outs], "grad_norm": grad_norm,
                   "lr": lr}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


def make_worker():
    return bare_worker(FakeTrainingWorker(), base_sync_done=True)


def fused_batch(counts: dict[int, int], seed: int) -> TensorDict:
    """A fused update call (one rank): each slot's rows one after another, the layout in the segments."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts.values())
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = (torch.rand(n, SEQ, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    td = TensorDict({
        "input_ids": torch.nested.nested_tensor_from_jagged(ids.reshape(-1), torch.arange(n + 1) * SEQ),
        "loss_mask": torch.nested.nested_tensor_from_jagged(mask.reshape(-1), torch.arange(n + 1) * SEQ),
        "advantages": torch.randn(n, generator=g),
    }, batch_size=[n])
    segments = [{"slot": k, "rows": c, "size": c} for k, c in counts.items()]
    tu.assign_non_tensor_data(td, SEGMENTS_KEY, encode_segments(segments))
    return td


def pair(num_slots: int):
    bank, res = make_worker(), make_worker()
    bank.populora_init_bank(num_slots, seed=3)
    res.populora_init_bank(num_slots, seed=3, layout="resident")
    assert isinstance(res.bank, ResidentAdapters)
    return bank, res


STEPS = [{0: 2, 1: 4, 3: 1}, {1: 2, 2: 3, 3: 2, 0: 1}, {2: 5, 0: 1}]


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_fused_update_trains_every_slot_as_the_bank_does(kernel, monkeypatch):
    import populora_verl.workers.resident as resident

    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    monkeypatch.setattr(resident, "grouped_mm_available", lambda x: kernel == "grouped")  # as on a Hopper GPU
    bank, res = pair(4)
    for i, counts in enumerate(STEPS):
        out_b = bank.update_actor(fused_batch(counts, seed=i))
        out_r = res.update_actor(fused_batch(counts, seed=i))
        mb, mr = out_b["metrics"]["populora_fused"], out_r["metrics"]["populora_fused"]
        assert mb.keys() == mr.keys() == {str(k) for k in counts}
        for k in mb:
            # the slot's own loss and gradient norm, as the bank's call of its own reports them
            assert sum(mb[k]["actor/pg_loss"]) == pytest.approx(mr[k]["actor/pg_loss"], rel=1e-5, abs=1e-7)
            assert mb[k]["grad_norm"] == pytest.approx(mr[k]["grad_norm"], rel=1e-4)
        for k in range(4):
            sb, sr = bank.populora_get_adapter(k), res.populora_get_adapter(k)
            for n in sb:
                torch.testing.assert_close(sb[n], sr[n], atol=1e-6, rtol=1e-5)
        assert bank.populora_bank_info()["slots"] == res.populora_bank_info()["slots"]
    # each slot's schedule moved once per call it trained in: slot 0 three times, the others twice
    bank.bank.swap_out()
    assert [res.bank.learning_rate(k) for k in range(4)] == pytest.approx([b.lrs[0] for b in bank.bank._slots])
    assert [res.bank.learning_rate(k) for k in range(4)] == pytest.approx([0.8e-2, 0.6e-2, 0.6e-2, 0.6e-2])
    assert bool(calls) == (kernel == "grouped")


def test_a_slot_call_of_its_own_and_the_reference_pass_on_resident_adapters():
    _, res = pair(2)
    before = [res.populora_get_adapter(k) for k in range(2)]
    data = fused_batch({1: 3}, seed=9)
    tu.pop(data, key=SEGMENTS_KEY)
    tu.assign_non_tensor_data(data, "populora_adapter", 1)
    res.update_actor(data)
    after = [res.populora_get_adapter(k) for k in range(2)]
    assert all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    assert any(not torch.equal(before[1][n], after[1][n]) for n in before[1])
    engine = res.actor.engine
    with engine.disable_adapter():  # the reference policy: the base model, whatever the slots hold
        ids = torch.randint(0, VOCAB, (1, SEQ))
        base = engine.module(input_ids=ids).logits
    with engine.module.disable_adapter():
        assert torch.equal(engine.module(input_ids=ids).logits, base)


def pushed(w):
    """Each weight transfer of the worker: ``{lora_int_id: tensors}`` and its targets (id, retired ids). Where verl
    loads one adapter per transfer under the caller's id (per-id weight sync), the worker sends one transfer per
    adapter: those of one sync are merged into one entry here, the one transfer the plugin's extension gets on verl
    0.9.1."""
    out = []
    for tensors, kw in w.rollout.pushes:
        if "lora_targets" not in kw:
            assert verl_compat.has_per_id_weight_sync(), kw
            out.append(({kw["lora_int_id"]: dict(tensors)}, [(kw["lora_int_id"], list(kw["retire_lora_int_ids"]))]))
            continue
        targets = kw["lora_targets"]
        groups = split_adapter_tensors(tensors.items(), [t["lora_int_id"] for t in targets])
        out.append((groups, [(t["lora_int_id"], t["retire"]) for t in targets]))
    if verl_compat.has_per_id_weight_sync() and out:
        out = [({k: v for g, _ in out for k, v in g.items()}, [t for _, ts in out for t in ts])]
    return out


def test_weight_sync_sends_the_changed_slots_in_one_transfer_and_resumes_across_layouts(tmp_path):
    bank, res = pair(3)
    asyncio.run(res.update_weights(global_steps=1))
    (groups, targets), = pushed(res)  # one transfer for every adapter
    assert targets == [(1000, []), (1001, []), (1002, [])]
    for k, lid in enumerate((1000, 1001, 1002)):
        ref = res.populora_get_adapter(k)
        assert groups[lid].keys() == ref.keys() and all(torch.equal(groups[lid][n], ref[n]) for n in ref)
    res.rollout.pushes.clear()
    asyncio.run(res.update_weights(global_steps=2))
    assert res.rollout.pushes == []  # nothing changed: nothing sent
    res.update_actor(fused_batch({2: 2}, seed=1))
    res.populora_set_adapter(0, {n: t + 1 for n, t in res.populora_get_adapter(1).items()})
    asyncio.run(res.update_weights(global_steps=3))
    (groups, targets), = pushed(res)  # the trained slot and the evolved one, the old id of the latter retired
    assert targets == [(1003, [1000]), (1002, [])]
    assert all(torch.equal(groups[1003][n], t) for n, t in res.populora_get_adapter(0).items())
    # a resident save resumes as a bank and as resident adapters, slot for slot
    res.populora_save_bank(str(tmp_path))
    as_bank, as_res = make_worker(), make_worker()
    info_b = as_bank.populora_load_bank(str(tmp_path))
    info_r = as_res.populora_load_bank(str(tmp_path), layout="resident")
    assert info_b["slots"] == info_r["slots"] == res.populora_bank_info()["slots"]
    for k in range(3):
        ref = res.populora_get_adapter(k)
        for w in (as_bank, as_res):
            got = w.populora_get_adapter(k)
            assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_an_unknown_layout_is_refused_in_one_line():
    w = make_worker()
    with pytest.raises(Exception, match="adapter layout must be one of"):
        w.populora_init_bank(2, seed=0, layout="stacked")



def micro_batch(row_slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 6, (len(row_slots),), generator=g)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offs[-1])
    td = TensorDict({
        "input_ids": torch.nested.nested_tensor_from_jagged(torch.randint(0, VOCAB, (n,), generator=g), offs),
        "loss_mask": torch.nested.nested_tensor_from_jagged((torch.rand(n, generator=g) > 0.3).float(), offs),
        "advantages": torch.randn(len(row_slots), generator=g),
        "populora_slot": torch.tensor(row_slots),
    }, batch_size=[len(row_slots)])
    tu.assign_non_tensor(td, batch_num_tokens=1.0, global_batch_size=len(row_slots))
    logp = torch.nested.nested_tensor_from_jagged(torch.randn(n, generator=g, requires_grad=True), offs)
    return td, {"log_probs": logp}


@pytest.mark.parametrize("rows", [[0, 1, 2], [1, 2], [0, 2, 3], [3]])
def test_selected_rows_equal_verls_row_selection(rows):
    from populora_verl.workers.resident_engine import select_rows, select_tensordict_rows

    td, out = micro_batch([0, 0, 1, 1])
    got, want = select_tensordict_rows(td, rows), tu.index_select_tensor_dict(td, rows)
    assert int(got.batch_size[0]) == len(rows)
    for key in ("input_ids", "loss_mask"):
        assert torch.equal(got[key].offsets(), want[key].offsets()) and torch.equal(got[key].values(), want[key].values())
    assert torch.equal(got["advantages"], want["advantages"])
    assert tu.get_non_tensor_data(got, "global_batch_size", None) == 4
    # verl's loss pads jagged fields: to the selected rows' longest, as verl's own selection does
    padded, want_padded = got.to_padded_tensor(), want.to_padded_tensor()
    for key in ("input_ids", "loss_mask"):
        assert padded[key].shape == want_padded[key].shape and torch.equal(padded[key], want_padded[key])
        assert padded[key].shape[1] == max(int(n) for n in td[key].offsets().diff()[rows])
    lp = select_rows(out["log_probs"], rows)
    ref = torch.cat([out["log_probs"].unbind()[i] for i in rows])
    assert torch.equal(lp.values(), ref)
    assert lp.to_padded_tensor(0.0).shape == (len(rows), padded["input_ids"].shape[1])
    packed = select_rows(out["log_probs"].values().reshape(1, -1), rows, td["input_ids"].offsets())
    assert torch.equal(packed.reshape(-1), ref)


def test_per_slot_loss_is_the_same_for_grouped_and_interleaved_rows():
    """Each slot's loss on its own rows with its own counts, whatever the rows' order in the micro-batch."""
    from populora_verl.workers.resident_engine import per_slot_loss

    grouped = [0, 0, 2, 1, 1, 1]
    interleaved = [1, 0, 2, 1, 0, 1]
    counts = {0: 7.0, 1: 11.0, 2: 3.0}
    rows = {0: 2, 1: 3, 2: 1}
    for order in (grouped, interleaved):
        td, out = micro_batch(order)
        seen = {}
        loss, _ = per_slot_loss(pg_loss, counts, rows, lambda k, m: seen.setdefault(k, m["actor/pg_loss"].aggregate()),
                                model_output=out, data=td)
        loss.backward()
        # by hand: each row's loss over its slot's tokens
        vals, offs, mask = out["log_probs"].values(), td["input_ids"].offsets().tolist(), td["loss_mask"].values()
        want = sum(-(td["advantages"][i] * vals[offs[i]:offs[i + 1]] * mask[offs[i]:offs[i + 1]]).sum() / counts[k]
                   for i, k in enumerate(order))
        torch.testing.assert_close(loss, want)
        assert set(seen) == {0, 1, 2}
        assert tu.get_non_tensor_data(td, "batch_num_tokens", None) == 1.0  # the caller's counts are kept


# --- slot micro-batching -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_slot_partitions_keep_each_slot_together_within_the_budget(seed):
    from populora_verl.workers.resident_engine import slot_partitions

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    slots = torch.randint(0, 6, (n,), generator=g).tolist()
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    budget = 32
    parts = slot_partitions(slots, lengths, budget)
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(p and sum(lengths[i] for i in p) <= budget for p in parts)
    order = [slots[i] for p in parts for i in p]
    assert len(order) - sum(1 for a, b in zip(order, order[1:]) if a == b) == len(set(slots))  # one run per slot
    assert len(parts) <= 2 * sum(lengths) // budget + 1  # as many parts as packing full needs: at most this many
    # and the tokens spread as evenly as the slot order allows: no cut of that order into as many parts has a smaller
    # largest part (the update's peak memory follows its largest micro-batch)
    ordered = [lengths[i] for p in parts for i in p]
    assert max(sum(lengths[i] for i in p) for p in parts) == least_largest_part(ordered, len(parts))
    # more parts on request (another rank needs more): split, never over the budget, until rows run out
    for count in (len(parts) + 1, n):
        more = slot_partitions(slots, lengths, budget, count)
        assert len(more) == count and sorted(i for p in more for i in p) == list(range(n))
        assert all(p and sum(lengths[i] for i in p) <= budget for p in more)
    assert slot_partitions(slots, lengths, budget, n + 1) == []


def least_largest_part(seq: list[int], count: int) -> int:
    """The smallest largest part of any cut of ``seq`` (in order) into ``count`` non-empty runs, by exhaustion."""
    import functools

    @functools.cache
    def best(start: int, parts: int) -> float:
        if parts == 1:
            return sum(seq[start:])
        return min((max(sum(seq[start:cut]), best(cut, parts - 1)) for cut in range(start + 1, len(seq) - parts + 2)),
                   default=float("inf"))

    return best(0, count)


def test_slot_partitions_spread_the_tokens_of_full_packing_evenly():
    from populora_verl.workers.resident_engine import slot_partitions

    # the single agent's rows at 1.5B (6 teacher rows of 1,595 tokens, 24 student rows of 1,242), 16,384-token
    # micro-batches: three, as packing full needs, but 13,296 / 13,662 / 12,420 tokens, not 15,780 / 16,146 / 7,452
    lengths = [1595] * 6 + [1242] * 24
    parts = slot_partitions([0] * 30, lengths, 16384)
    assert [sum(lengths[i] for i in p) for p in parts] == [13296, 13662, 12420]
    assert [i for p in parts for i in p] == list(range(30))


def test_slot_partitions_refuse_a_row_over_the_budget_and_keep_a_grouped_layout_in_order():
    from populora_verl.workers.resident_engine import slot_partitions

    assert slot_partitions([0, 1], [5, 9], 8) == []
    # rows grouped by slot (the fused call's layout) stay runs of consecutive rows, slots in their layout order
    assert slot_partitions([2, 2, 0, 0, 1], [3, 3, 3, 3, 3], 6) == [[0, 1], [2, 3], [4]]
    assert slot_partitions([2, 0, 2], [1, 1, 1], 8) == [[0, 2, 1]]
