"""Resident adapters inside verl 0.9.1's own FSDP language-model engine code, on the CPU, against verl's plain
engine with the adapter bank's live adapter.

test_resident_worker.py drives the resident mixin through a stand-in engine. Here the engine is verl's
``FSDPEngineWithLMHead`` itself (built without its GPU set-up): its ``forward_backward_batch`` (token counts, the
dynamic micro-batching that balances rows across micro-batches), ``forward_step``, ``prepare_model_inputs`` /
``prepare_model_outputs`` on one packed row (``attn_implementation=populora_varlen``), verl's ``ppo_loss`` on the
batch as verl's trainer hands it over (``left_right_2_no_padding``: nested ids and positions, dense prompts,
responses, masks, old log-probs and advantages, non-tensor rows; or old log-probs and advantages jagged, as they
come out of TransferQueue), and its optimizer step for the reference. Both
resident kernels run: the per-slot loop and torch's grouped matmul (which the CPU runs in fp32 with the same layout
rules as CUDA). Each slot's gradient, clipped norm and log-probs must be those of the bank training that slot alone
on its own rows."""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from peft import LoraConfig, get_peft_model  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.config.actor import FSDPActorConfig  # noqa: E402
from verl.workers.engine import utils as engine_utils  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import populora_verl.workers.resident as resident  # noqa: E402
from populora_verl import verl_compat  # noqa: E402
from populora_verl.workers import resident_engine, varlen_attention  # noqa: E402
from populora_verl.workers.adapter_bank import AdapterBank  # noqa: E402

VOCAB, PROMPT, RESPONSE, SLOTS, CLIP, LR = 64, 6, 8, 4, 0.05, 1e-2
MAX_TOKENS = 40  # tokens per micro-batch: about three rows, so micro-batches mix slots


@contextlib.contextmanager
def cpu_rank(store_file: str):
    """A one-rank gloo group (verl's engine all-reduces its token counts) and verl's device queries on the CPU; the
    benchmarks beside this file run the engine under it too."""
    import verl.utils.seqlen_balancing  # noqa: F401  (imported before the device queries are pointed at the CPU)

    varlen_attention.register()
    mp = pytest.MonkeyPatch()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("verl") and hasattr(mod, "get_device_name"):
            mp.setattr(mod, "get_device_name", lambda: "cpu")
            if hasattr(mod, "get_device_id"):
                mp.setattr(mod, "get_device_id", lambda: "cpu")
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
    try:
        yield
    finally:
        if ours:
            dist.destroy_process_group()
        mp.undo()


@pytest.fixture(scope="module", autouse=True)
def one_cpu_rank(tmp_path_factory):
    with cpu_rank(str(tmp_path_factory.mktemp("gloo") / "store")):
        yield


def verl_engine(resident_slots: bool, *, vocab: int = VOCAB, hidden: int = 32, intermediate: int = 48,
                layers: int = 2, rank: int = 8):
    """verl's engine around a tiny PEFT Qwen2 with slots 0..3 (the same weights either way): resident adapters
    installed on it, or the bank with verl's own optimizer step. The sizes are for the memory benchmark."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = varlen_attention.NAME
    model = get_peft_model(transformers.Qwen2ForCausalLM(cfg), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    cls = transformer_impl.FSDPEngineWithLMHead
    if resident_slots and verl_compat.engine_class_from_config():
        cls = resident_engine.ResidentFSDPEngineWithLMHead  # what verl builds from the engine_class the trainer sets
    eng = cls.__new__(cls)
    eng.module = model
    eng.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    eng.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda s: 1.0)
    eng.optimizer_config = types.SimpleNamespace(clip_grad=CLIP)
    eng.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                              use_no_sync_for_gradient_accumulation=True)
    eng.ulysses_sequence_parallel_size, eng.use_ulysses_sp, eng.ulysses_device_mesh = 1, False, None
    eng.pad_to_length, eng._autocast_dtype, eng.scaler, eng._qat_enabled = False, torch.float32, None, False
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    store = (resident.ResidentAdapters if resident_slots else AdapterBank)(model, eng.optimizer, eng.lr_scheduler)
    store.init_slots(SLOTS, seed=3)
    g = torch.Generator().manual_seed(1)
    for k in range(SLOTS):  # lora_B is zero at init: every weight gets a gradient and the slots differ
        store.set_adapter_state(k, {n: v + 0.05 * torch.randn(v.shape, generator=g)
                                    for n, v in store.get_adapter_state(k).items()})
    if resident_slots:
        resident_engine.install(eng, store)
    return eng, store


def padded_rows(n: int, seed: int) -> TensorDict:
    """``n`` rows as verl's trainer holds them: left-padded prompts, right-padded responses, uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, PROMPT + 1, (n,), generator=g).tolist()
    rlen = torch.randint(2, RESPONSE + 1, (n,), generator=g).tolist()
    prompts = torch.zeros(n, PROMPT, dtype=torch.long)
    responses = torch.zeros(n, RESPONSE, dtype=torch.long)
    attn = torch.zeros(n, PROMPT + RESPONSE, dtype=torch.long)
    for i in range(n):
        prompts[i, PROMPT - plen[i]:] = torch.randint(1, VOCAB, (plen[i],), generator=g)
        responses[i, : rlen[i]] = torch.randint(1, VOCAB, (rlen[i],), generator=g)
        attn[i, PROMPT - plen[i]: PROMPT + rlen[i]] = 1
    mask = attn[:, PROMPT:].clone()
    return TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn, "response_mask": mask, "position_ids": (attn.cumsum(-1) - 1).clamp_min(0),
        "old_log_probs": -torch.rand(n, RESPONSE, generator=g) * mask,
        "advantages": torch.randn(n, 1, generator=g).expand(n, RESPONSE) * mask,
    }, batch_size=[n])


def actor_batch(rows: TensorDict, slots: list[int] | None, jagged: bool = False) -> TensorDict:
    """verl's no-padding layout of ``rows`` with the keys its actor reads (and per-row strings, as a trainer's);
    ``jagged``: old log-probs and advantages as jagged rows, as they come out of TransferQueue."""
    td = rows.clone()
    n = int(td.batch_size[0])
    if slots is not None:
        td[resident_engine.SLOT_FIELD] = torch.tensor(slots, dtype=torch.long)
    td = left_right_2_no_padding(td)
    for key in ("old_log_probs", "advantages") if jagged else ():
        td[key] = torch.nested.as_nested_tensor(list(td[key].unbind(0)), layout=torch.jagged)
    tu.assign_non_tensor(td, uid=[f"u{i}" for i in range(n)], extra_info=[{"row": i} for i in range(n)])
    tu.assign_non_tensor(td, temperature=1.0, use_remove_padding=True, use_dynamic_bsz=True,
                         max_token_len_per_gpu=MAX_TOKENS, use_fused_kernels=False, calculate_entropy=False,
                         global_batch_size=n, mini_batch_size=n)
    return td


def loss_fn():
    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                          use_dynamic_bsz=True, ppo_max_token_len_per_gpu=MAX_TOKENS, rollout_n=1)
    return functools.partial(ppo_loss, cfg)


def grads_at_step(eng, params_of):
    """Wrap ``eng.optimizer_step``: the gradients it sees, per slot, before it clips them."""
    seen = {}
    step = eng.optimizer_step

    def wrapped():
        for k, params in params_of().items():
            seen[k] = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        return step()

    eng.optimizer_step = wrapped
    return seen


ROWS = {
    # the fused call's layout: each slot's rows together, slots in any order (micro-batches keep the order)
    "grouped": [2, 2, 0, 0, 0, 3, 1, 1, 1, 2],
    "interleaved": [1, 0, 1, 0, 2, 3, 2, 3, 0, 1],
}


def slots_per_micro_batch(eng) -> tuple[list[set[int]], list[bool]]:
    """Record the slots of every micro-batch ``eng`` runs, and whether verl's module-level ``prepare_micro_batches``
    was rebound while it ran."""
    seen, rebound = [], []
    step = eng.forward_step

    def wrapped(micro_batch, *args, **kwargs):
        seen.append(set(micro_batch[resident_engine.SLOT_FIELD].reshape(-1).tolist()))
        rebound.append(transformer_impl.prepare_micro_batches is not engine_utils.prepare_micro_batches)
        return step(micro_batch, *args, **kwargs)

    eng.forward_step = wrapped
    return seen, rebound


@pytest.mark.parametrize("layout", list(ROWS))
@pytest.mark.parametrize("kernel", ["loop", "grouped"])
@pytest.mark.parametrize("jagged", [False, True], ids=["dense", "jagged"])
@pytest.mark.parametrize("micro", ["slot", "verl"])
def test_update_and_log_probs_through_verls_engine_equal_each_slot_trained_alone(
        layout, kernel, jagged, micro, monkeypatch):
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    monkeypatch.setattr(resident, "grouped_mm_available", lambda x: kernel == "grouped")
    monkeypatch.setenv(resident_engine.MICRO_BATCH_ENV, micro)
    slots = ROWS[layout]
    rows = padded_rows(len(slots), seed=5)

    eng, store = verl_engine(resident_slots=True)
    micro_slots, rebound = slots_per_micro_batch(eng)
    got_logp = eng.infer_batch(actor_batch(rows, slots, jagged))["model_output"]["log_probs"]
    got = grads_at_step(eng, lambda: {k: {n: store._slot_param(k, n) for n in store._params} for k in set(slots)})
    micro_slots.clear()  # the update's micro-batches
    eng.train_batch(actor_batch(rows, slots, jagged), loss_function=loss_fn())
    assert transformer_impl.prepare_micro_batches is engine_utils.prepare_micro_batches  # verl's own again after
    # a verl with FSDPEngine.prepare_micro_batches (patch 0014) splits through the engine's method; verl 0.9.1 calls
    # the module-level function, which slot micro-batching rebinds during the call
    assert any(rebound) == (micro == "slot" and not verl_compat.has_engine_micro_batch_hook()), rebound
    per_slot = eng.populora_slot_metrics()
    assert (len(calls) > 0) == (kernel == "grouped")
    # slot micro-batching keeps each slot's rows together: a slot's rows span micro-batches only at their edges,
    # where verl's balanced partition scatters them
    pairs = sum(len(m) for m in micro_slots)
    spread = pairs - (len(micro_slots) + len(set(slots)) - 1)
    if micro == "slot":
        assert spread <= 0, micro_slots
    elif layout == "grouped":  # this batch tells the two apart
        assert spread > 0, micro_slots

    ref, bank = verl_engine(resident_slots=False)
    for k in sorted(set(slots)):
        mine = [i for i, s in enumerate(slots) if s == k]
        own = tu.index_select_tensor_dict(rows, mine)
        with bank.active(k, train=False):
            want_logp = ref.infer_batch(actor_batch(own, None, jagged))["model_output"]["log_probs"]
        for j, i in enumerate(mine):  # a row's last log-prob scores the next packed row's first token: left out
            torch.testing.assert_close(got_logp[i][:-1], want_logp[j][:-1], atol=1e-5, rtol=1e-5)
        want = grads_at_step(ref, lambda: {"live": dict(bank._params)})
        with bank.active(k, train=True):
            out = ref.train_batch(actor_batch(own, None, jagged), loss_function=loss_fn())
        assert per_slot[k]["grad_norm"] == pytest.approx(out["metrics"]["grad_norm"], rel=1e-4)
        assert got[k].keys() == want["live"].keys()
        for n in want["live"]:
            torch.testing.assert_close(got[k][n], want["live"][n], atol=1e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        after = store.get_adapter_state(k)
        for key, t in bank.get_adapter_state(k).items():
            torch.testing.assert_close(after[key], t, atol=1e-6, rtol=1e-4)


def even_rows(n: int, prompt: int, response: int, vocab: int) -> TensorDict:
    """``n`` rows of ``prompt`` + ``response`` tokens each, in verl's trainer layout."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (n, prompt + response), generator=g)
    attn = torch.ones(n, prompt + response, dtype=torch.long)
    mask = torch.ones(n, response, dtype=torch.long)
    return TensorDict({
        "prompts": ids[:, :prompt], "responses": ids[:, prompt:], "input_ids": ids, "attention_mask": attn,
        "response_mask": mask, "position_ids": attn.cumsum(-1) - 1,
        "old_log_probs": -torch.rand(n, response, generator=g), "advantages": torch.randn(n, response, generator=g),
    }, batch_size=[n])


def test_one_slot_update_and_log_probs_peak_at_the_banks_memory_plus_one_copy_of_the_slot(monkeypatch):
    """The peak of an update grows with the tokens of its largest micro-batch (its activations and logits), so the
    resident micro-batches must be no larger than verl's balanced ones where the rows allow it: 24 rows of 12 tokens
    under a 164-token budget are two micro-batches of 144 in both layouts (packing them full made 156 + 132). What
    the resident code itself may add at the same micro-batches is one copy of the present slot's weights in the
    compute dtype, which the LoRA matmuls save for backward. Bytes are counted from the tensors (deterministic)."""
    from populora_verl.bench.live_bytes import LiveBytes
    from populora_verl.workers import lora_forward

    monkeypatch.setenv(resident_engine.MICRO_BATCH_ENV, "slot")
    monkeypatch.setattr(resident, "grouped_mm_available", lambda x: False)
    vocab, budget = 4096, 164
    dims = {"vocab": vocab, "hidden": 64, "intermediate": 96}
    rows = even_rows(24, 2, 10, vocab)

    def batch(slots):
        td = actor_batch(rows, slots, jagged=True)
        tu.assign_non_tensor(td, max_token_len_per_gpu=budget)
        return td

    def measure(eng, active, slots):
        micro, step = [], eng.forward_step
        eng.forward_step = lambda mb, *a, **k: micro.append(int(mb["input_ids"].offsets()[-1])) or step(mb, *a, **k)
        peaks = {}
        for phase in ("update", "log_probs", "update", "log_probs"):  # the second round is measured: moments exist
            with active(phase == "update"):
                eng.optimizer_zero_grad()
                micro.clear()
                with LiveBytes() as live:
                    if phase == "update":
                        eng.train_batch(batch(slots), loss_function=loss_fn())
                    else:
                        eng.infer_batch(batch(slots))
                peaks[phase] = (live.peak, list(micro))
        return peaks

    eng, store = verl_engine(resident_slots=True, **dims)
    got = measure(eng, lambda train: contextlib.nullcontext(), [0] * 24)
    slot_bytes = sum(p.numel() * p.element_size() for p in store.slot_parameters(0))

    lora_forward.install("lean")  # the bank's forward in the GPU runs
    try:
        ref, bank = verl_engine(resident_slots=False, **dims)
        want = measure(ref, lambda train: bank.active(0, train=train), None)
    finally:
        lora_forward.uninstall()
    for phase in ("update", "log_probs"):
        (peak, micro), (bank_peak, bank_micro) = got[phase], want[phase]
        assert peak <= bank_peak + slot_bytes, (phase, micro, bank_micro, peak, bank_peak, slot_bytes)
        assert micro == [144, 144] and sorted(bank_micro) == [144, 144], (phase, micro, bank_micro)


def test_install_attaches_the_store_to_the_engine_verl_built_and_swaps_only_another():
    from verl.utils.import_utils import load_class_from_fqn

    resident_cls = resident_engine.ResidentFSDPEngineWithLMHead
    assert load_class_from_fqn(resident_engine.RESIDENT_ENGINE_FQN) is resident_cls
    assert issubclass(resident_cls, transformer_impl.FSDPEngineWithLMHead)
    store = object()
    built = resident_cls.__new__(resident_cls)  # verl's worker built the class named in engine_class
    assert resident_engine.install(built, store) is built
    assert type(built) is resident_cls and built.populora_resident is store
    plain = transformer_impl.FSDPEngineWithLMHead.__new__(transformer_impl.FSDPEngineWithLMHead)
    if verl_compat.public_only():  # the series applied: the class swap is a private path
        with pytest.raises(verl_compat.PrivateVerlUse):
            resident_engine.install(plain, store)
    else:  # verl 0.9.1: the engine's class becomes the same resident class
        resident_engine.install(plain, store)
        assert type(plain) is resident_cls and plain.populora_resident is store
