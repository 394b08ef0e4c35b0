"""Resident adapters in a Qwen2 model shaped like Qwen2.5-Coder-1.5B (2 decoder layers, random weights, LoRA r16 on
every linear, 8 slots), on one packed row of about 16k tokens as verl's remove-padding path gives it, with
``attn_implementation=populora_varlen``, Liger's RMSNorm, RoPE and SwiGLU when liger_kernel imports (on CUDA), bf16
base weights under autocast and fp32 slots. For each row layout (slots grouped in ascending or any order, one slot,
rows interleaved) it trains one step with the grouped kernel and with the per-slot loop and compares loss and slot
gradients, then runs a no-grad forward. Needs torch, transformers and peft (liger_kernel optional); prints OK or FAIL
with the traceback per case and exits 1 when one fails.

    python3 scripts/gpu/resident_model_check.py          # CUDA (the grouped kernel needs compute capability 9.0+)
    python3 scripts/gpu/resident_model_check.py cpu      # the same cases at a tiny width on the CPU
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEV = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
SMALL = DEV.type == "cpu"
FAILED: list[str] = []
T0 = time.time()


def case(name, fn):
    try:
        print(f"OK   {name}: {fn()}  [{time.time() - T0:.1f}s]", flush=True)
    except Exception:
        FAILED.append(name)
        print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)


import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

import populora_verl.workers.resident as R  # noqa: E402
from populora_verl.workers import varlen_attention  # noqa: E402

varlen_attention.register()

try:
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    HAVE_LIGER = DEV.type == "cuda"
except Exception as e:  # noqa: BLE001
    print("no liger:", e)
    HAVE_LIGER = False

H, INTER, NH, KV, V = (1536, 8960, 12, 2, 2048) if not SMALL else (64, 96, 4, 2, 128)
RANK = 16


def build(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=NH,
        num_key_value_heads=KV,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = varlen_attention.NAME
    base = transformers.Qwen2ForCausalLM(cfg)
    if HAVE_LIGER:
        _apply_liger_kernel_to_instance(model=base, fused_linear_cross_entropy=False, swiglu=True)
    model = get_peft_model(
        base,
        LoraConfig(
            r=RANK,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    model.to(DEV)
    model.enable_input_require_grads() if hasattr(model, "enable_input_require_grads") else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    res = R.ResidentAdapters(model, opt)
    res.init_slots(8, seed=3)
    g = torch.Generator().manual_seed(7)
    for k in range(8):  # non-zero B
        res.set_adapter_state(
            k, {n: v + 0.02 * torch.randn(v.shape, generator=g) for n, v in res.get_adapter_state(k).items()}
        )
    # FSDP2's mixed precision: the base computes in bf16, the slots stay fp32
    for n, p in model.named_parameters():
        if "lora_" not in n:
            p.data = p.data.to(torch.bfloat16)
    return model, res


def batch(row_slots, seed=0, total=16000 if not SMALL else 300):
    g = torch.Generator().manual_seed(seed)
    n = len(row_slots)
    lengths = torch.randint(total // n // 2, total // n * 3 // 2, (n,), generator=g).tolist()
    ids = torch.randint(0, V, (1, sum(lengths)), generator=g).to(DEV)
    pos = torch.cat([torch.arange(L) for L in lengths]).reshape(1, -1).to(DEV)
    return ids, pos, lengths


def step(model, res, row_slots, seed=0, train=True):
    ids, pos, lengths = batch(row_slots, seed)
    r = R.SlotRouting.from_rows(row_slots, lengths, res.num_slots, device=DEV)
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx, torch.autocast(DEV.type, dtype=torch.bfloat16), R.routing(r):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1)[..., None]).squeeze(-1)
        slots = torch.repeat_interleave(torch.tensor(row_slots), torch.tensor(lengths)).to(DEV)
        loss = -(logp * (1.0 + slots.float() / 8)).mean()
    if not train:
        return float(loss)
    loss.backward()
    trained = sorted(set(row_slots))
    grads = {k: [p.grad.detach().clone() for p in res.slot_parameters(k)] for k in trained}
    layouts = {(p.grad.is_contiguous()) for k in trained for p in res.slot_parameters(k)}
    norms = res.optimizer_step(1.0, trained)
    assert all(torch.isfinite(torch.tensor(v)) for v in norms.values()), norms
    return float(loss.detach()), grads, layouts


LAYOUTS = {
    "grouped ascending 8 slots": [k for k in range(8) for _ in range(2)],
    "grouped shuffled 8 slots": [k for k in (5, 2, 7, 0, 3, 6, 1, 4) for _ in range(2)],
    "one slot": [3] * 6,
    "interleaved 8 slots": [k % 8 for k in range(16)],
    "grouped 3 slots": [6, 6, 1, 1, 1, 4],
}


def compare(name, rows):
    def run():
        out = {}
        for grouped in (True, False):
            orig = R.grouped_mm_available
            R.grouped_mm_available = (lambda x: x.dtype == torch.bfloat16) if grouped else (lambda x: False)
            try:
                model, res = build()
                out[grouped] = step(model, res, rows)
                out[grouped] = out[grouped] + (step(model, res, rows, seed=1, train=False),)
            finally:
                R.grouped_mm_available = orig
        (l1, g1, lay1, f1), (l0, g0, lay0, f0) = out[True], out[False]
        err = max(
            ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for k in g0 for a, b in zip(g1[k], g0[k])
        )
        assert abs(l1 - l0) < 1e-2 * abs(l0) + 1e-3, (l1, l0)
        assert err < 5e-2, err
        return (
            f"loss {l1:.5f}/{l0:.5f}, grad rel err {err:.1e}, grads contiguous {lay1}/{lay0}, no-grad {f1:.5f}/{f0:.5f}"
        )

    case(f"model {name} grouped vs loop", run)


def nested_case():
    from populora_verl.workers.resident_engine import _jagged_rows

    lengths = torch.tensor([5, 3, 7, 2, 4])
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(DEV)
    vals = torch.randn(int(lengths.sum()), device=DEV, requires_grad=True)
    v, o = _jagged_rows(vals, offs, [1, 2, 3])
    nt = torch.nested.nested_tensor_from_jagged(v, o)
    padded = torch.nested.to_padded_tensor(nt, 0.0)
    padded.sum().backward()
    return f"padded {tuple(padded.shape)}, grad hits {int((vals.grad != 0).sum())}"


if __name__ == "__main__":
    print(f"device {DEV}, torch {torch.__version__}, transformers {transformers.__version__}, liger {HAVE_LIGER}")
    case("nested rows on device", nested_case)
    for name, rows in LAYOUTS.items():
        compare(name, rows)
    print(f"{len(FAILED)} failed" + (": " + "; ".join(FAILED) if FAILED else ""), flush=True)
    sys.exit(1 if FAILED else 0)
