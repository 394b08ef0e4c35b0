"""The resident layout's kernels and row selection on a CUDA GPU, against an fp32 reference: needs torch only, so it
runs on a bare GPU node before anything is staged. Each case prints OK with its error, or FAIL with the traceback.

    python3 scripts/gpu/resident_cuda_check.py            # exit code 1 when a case fails
    python3 scripts/gpu/resident_cuda_check.py cpu        # the same cases on the CPU
"""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from populora_verl.workers.resident import SlotRouting, grouped_mm_available, lora_add, slot_token_mean  # noqa: E402
from populora_verl.workers.resident_engine import row_token_counts, select_rows  # noqa: E402

DEV = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
FAILED: list[str] = []


def case(name: str):
    def wrap(fn):
        try:
            print(f"OK   {name}: {fn()}", flush=True)
        except Exception:
            FAILED.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        return fn

    return wrap


def _slots(n_slots: int, d_in: int, d_out: int, rank: int, gen: torch.Generator):
    a = [(torch.randn(rank, d_in, generator=gen) * 0.05).to(DEV).requires_grad_() for _ in range(n_slots)]
    b = [(torch.randn(d_out, rank, generator=gen) * 0.05).to(DEV).requires_grad_() for _ in range(n_slots)]
    return a, b


def _kernel(
    layout: str, n_slots: int, grouped: bool, contiguous: bool, pad: int = 0, d_in=1536, d_out=256, rank=16
) -> str:
    gen = torch.Generator().manual_seed(n_slots * 7 + len(layout))
    lengths = [int(v) for v in torch.randint(40, 300, (4 * n_slots,), generator=gen)]
    if layout == "grouped":  # each slot's rows together, slots in a shuffled order
        order = torch.randperm(n_slots, generator=gen).tolist()
        rows = [k for k in order for _ in range(4)]
    else:
        rows = [i % n_slots for i in range(4 * n_slots)]
    n = sum(lengths)
    r = SlotRouting.from_rows(rows, lengths, n_slots, device=DEV)
    base = torch.randn(n + pad, 2 * d_in if not contiguous else d_in, generator=gen).to(DEV, torch.bfloat16)
    x = (base[:, ::2] if not contiguous else base).requires_grad_(False)
    out0 = torch.randn(n + pad, d_out, generator=gen).to(DEV, torch.bfloat16)
    a, b = _slots(n_slots, d_in, d_out, rank, gen)
    y = lora_add(out0, x, r, a, b, 2.0, grouped=grouped)
    g = torch.randn_like(y)
    (y.float() * g.float()).sum().backward()
    # fp32 reference token by token
    token_slot = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths)).to(DEV)
    xf = x[:n].float()
    ref = out0.float().clone()
    grads_a, grads_b = [], []
    for k in range(n_slots):
        ak, bk = a[k].detach().clone().requires_grad_(), b[k].detach().clone().requires_grad_()
        sel = token_slot == k
        yk = out0[:n][sel].float() + 2.0 * (xf[sel] @ ak.t()) @ bk.t()
        (yk * g[:n][sel].float()).sum().backward()
        ref[:n][sel] = yk.detach()
        grads_a.append(ak.grad)
        grads_b.append(bk.grad)
    scale = ref.abs().max().item()
    err_y = (y.float() - ref).abs().max().item() / scale
    err_g = max(
        ((a[k].grad - grads_a[k]).abs().max() / grads_a[k].abs().max().clamp_min(1e-12)).item() for k in range(n_slots)
    )
    err_g = max(
        err_g,
        *(
            ((b[k].grad - grads_b[k]).abs().max() / grads_b[k].abs().max().clamp_min(1e-12)).item()
            for k in range(n_slots)
        ),
    )
    if err_y > 3e-2 or err_g > 5e-2:
        raise AssertionError(f"relative error output {err_y:.2e}, gradients {err_g:.2e}")
    return f"output {err_y:.1e}, gradients {err_g:.1e}"


def main() -> int:
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    x = torch.zeros(8, 16, device=DEV, dtype=torch.bfloat16)
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, grouped_mm available {grouped_mm_available(x)}")
    for layout in ("grouped", "interleaved"):
        for n_slots in (1, 3, 8):
            for grouped in (True, False):
                for contiguous in (True, False):
                    for pad in (0, 5):
                        name = (
                            f"lora_add {layout} slots={n_slots} grouped_mm={grouped} contiguous={contiguous} pad={pad}"
                        )
                        case(name)(functools.partial(_kernel, layout, n_slots, grouped, contiguous, pad))

    @case("select_rows on a jagged tensor (consecutive and scattered rows), backward")
    def _():
        lengths = torch.tensor([5, 3, 7, 2, 4])
        vals = torch.randn(int(lengths.sum()), device=DEV, requires_grad=True)
        offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(DEV)
        nt = torch.nested.nested_tensor_from_jagged(vals, offs)
        total = 0
        for rows in ([1, 2, 3], [0, 2, 4]):
            sub = select_rows(nt, rows)
            got = row_token_counts(torch.nested.nested_tensor_from_jagged(torch.ones_like(sub.values()), sub.offsets()))
            assert got.tolist() == [int(lengths[i]) for i in rows], got
            total = total + sub.values().sum()
            packed = select_rows(vals.reshape(1, -1), rows, offs)
            assert packed.shape[1] == sum(int(lengths[i]) for i in rows)
        total.backward()
        return f"grad rows hit {int((vals.grad != 0).sum())}"

    @case("slot_token_mean")
    def _():
        loss = torch.rand(4, 6, device=DEV)
        mask = torch.ones(4, 6, device=DEV)
        slots = torch.tensor([0, 0, 2, 2], device=DEV)
        v = slot_token_mean(loss, mask, slots, {0: 12.0, 2: 12.0})
        assert torch.allclose(v, loss[:2].sum() / 12 + loss[2:].sum() / 12)
        return f"{v.item():.4f}"

    print(f"{len(FAILED)} failed" + (": " + "; ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
