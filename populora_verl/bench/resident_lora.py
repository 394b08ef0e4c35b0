"""The LoRA part of a population's update, one adapter at a time against every adapter resident, side by side.

What it runs, on a stack of a model's linear layers (Qwen2.5-1.5B's shapes by default: 28 layers of q, k, v, o,
gate, up and down, frozen bf16 base weights, fp32 LoRA weights of rank 64 cast to bf16 for the matmuls, as FSDP's
mixed precision does), for one step's tokens of each adapter:

* ``bank``: today's path. Per adapter: copy its weights and AdamW moments in from pinned host memory, forward and
  backward its tokens in micro-batches of ``--micro-tokens``, one AdamW step, copy weights and moments back out.
* ``resident_loop``: every adapter resident. All tokens, sorted by adapter, in micro-batches of ``--micro-tokens``
  (mixed adapters), one forward and backward each with the per-slot loop kernel, then one AdamW over one group per
  adapter.
* ``resident_grouped``: the same with ``torch._grouped_mm`` (bf16, compute capability 9.0+; skipped elsewhere).

Arms run interleaved over ``--rounds`` rounds after a warm-up round; each prints its median and spread (min-max) and
its ratio to ``bank``, and the largest per-token difference between the two resident kernels' outputs::

    python -m populora_verl.bench.resident_lora --device cuda --tokens 10000x4,30000x4    # 4T4S, one step
    python -m populora_verl.bench.resident_lora                                            # CPU, shapes / 64

Attention, norms and the LM head are left out: they cost the same in every arm, so the ratios here are upper bounds
of what the LoRA layout changes in a whole update.

``--count-ops`` times nothing: it counts what one micro-batch's forward and backward of one decoder layer's seven
LoRA linears (Qwen2.5-1.5B's shapes, ``--micro-tokens`` tokens, LoRA rank ``--rank``) dispatch, at full size on
shape-only (``meta``) tensors, so it runs on a CPU in seconds and its figures are a GPU's: the aten ops that launch a
kernel (views and allocations excluded) and the bytes their outputs write, for the base linears alone, the bank's
lean forward (one live adapter, :mod:`populora_verl.workers.lora_forward`) and the resident forward hook with 1, 8
and 16 slots present, tokens sorted by slot or rows interleaved::

    python -m populora_verl.bench.resident_lora --count-ops --rank 16
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import statistics
import sys
import time
import types
from collections.abc import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from populora_verl.workers import resident
from populora_verl.workers.resident import SlotRouting, grouped_mm_available, lora_add, lora_delta

__all__ = ["Stack", "parse_tokens", "OpCount", "count_layer_ops", "main"]

QWEN_1_5B = {"layers": 28, "hidden": 1536, "intermediate": 8960, "kv": 256}
ARMS = ("bank", "resident_loop", "resident_grouped")


def parse_tokens(spec: str) -> list[int]:
    """``10000x4,30000x4`` -> four adapters of 10,000 tokens then four of 30,000."""
    out: list[int] = []
    for part in spec.split(","):
        n, _, times = part.strip().partition("x")
        if not n.isdigit() or (times and not times.isdigit()):
            raise SystemExit(f"--tokens: expected TOKENS[xCOUNT],... got {spec!r}")
        out += [int(n)] * int(times or 1)
    if not out or min(out) < 1:
        raise SystemExit(f"--tokens: every adapter needs at least one token, got {spec!r}")
    return out


class Stack:
    """The linear layers of a decoder stack with one base weight each and ``slots`` LoRA adapters."""

    def __init__(self, slots: int, rank: int, dims: dict[str, int], device: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        h, i, kv = dims["hidden"], dims["intermediate"], dims["kv"]
        self.shapes = [
            ("q", h, h),
            ("k", h, kv),
            ("v", h, kv),
            ("o", h, h),
            ("gate", h, i),
            ("up", h, i),
            ("down", i, h),
        ]
        self.layers = []
        for _ in range(dims["layers"]):
            layer = {}
            for name, fan_in, fan_out in self.shapes:
                base = (torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5).to(device, torch.bfloat16)
                a = [
                    torch.nn.Parameter((torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).to(device))
                    for _ in range(slots)
                ]
                b = [
                    torch.nn.Parameter((torch.randn(fan_out, rank, generator=gen) * 1e-3).to(device))
                    for _ in range(slots)
                ]
                layer[name] = (base, a, b)
            self.layers.append(layer)
        self.scaling = 1.0
        self.hidden = h

    def slot_params(self, k: int) -> list[torch.nn.Parameter]:
        return [p for layer in self.layers for _, a, b in layer.values() for p in (a[k], b[k])]

    def forward(self, x: torch.Tensor, r: SlotRouting, *, grouped: bool, only: int | None = None) -> torch.Tensor:
        """A residual stream through every layer: attention projections from x, the MLP's down(gate * up).
        ``only``: adapter ``only``'s LoRA alone (the bank's live adapter; ``r`` then routes one slot)."""

        def lin(name: str, layer, inp):
            base, a, b = layer[name]
            if only is not None:
                a, b = [a[only]], [b[only]]
            return lora_add(inp @ base.t(), inp, r, a, b, self.scaling, grouped=grouped)

        for layer in self.layers:
            q, k, v, o = (lin(n, layer, x) for n in ("q", "k", "v", "o"))
            mlp = lin("down", layer, torch.nn.functional.silu(lin("gate", layer, x)) * lin("up", layer, x))
            x = x + 0.1 * (q + o + mlp) + 0.01 * (k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True))
        return x


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Arm:
    def __init__(self, stack: Stack, tokens: Sequence[int], micro: int, device: str, seed: int) -> None:
        self.stack, self.tokens, self.micro, self.device = stack, list(tokens), micro, device
        gen = torch.Generator().manual_seed(seed)
        self.x = (torch.randn(sum(tokens), stack.hidden, generator=gen) * 0.1).to(device, torch.bfloat16)
        self.slot_of_token = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(tokens)).to(device)
        n = len(tokens)
        self.opt_groups = torch.optim.AdamW(
            [{"params": stack.slot_params(k)} for k in range(n)], lr=1e-6, weight_decay=0.01, foreach=True
        )
        self.opt_one = [
            torch.optim.AdamW(stack.slot_params(k), lr=1e-6, weight_decay=0.01, foreach=True) for k in range(n)
        ]
        # the bank's host copies: each adapter's weights and two moments, pinned where a GPU is
        pin = device.startswith("cuda")
        self.host = [
            [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in stack.slot_params(k) for _ in range(3)]
            for k in range(n)
        ]

    def _pass(self, start: int, end: int, *, grouped: bool, only: int | None = None) -> None:
        if only is None:
            r = SlotRouting.from_tokens(self.slot_of_token[start:end], len(self.tokens))
        else:
            r = SlotRouting.from_tokens(torch.zeros(end - start, dtype=torch.long, device=self.x.device), 1)
        out = self.stack.forward(self.x[start:end], r, grouped=grouped, only=only)
        out.float().square().mean().backward()

    def bank(self) -> None:
        offset = 0
        for k, n in enumerate(self.tokens):
            params = self.stack.slot_params(k)
            with torch.no_grad():  # swap in: weights and moments from the host
                for j, p in enumerate(params):
                    p.copy_(self.host[k][3 * j], non_blocking=True)
            for s, e in _chunks(n, self.micro):
                self._pass(offset + s, offset + e, grouped=False, only=k)
            self.opt_one[k].step()
            self.opt_one[k].zero_grad(set_to_none=True)
            with torch.no_grad():  # swap out: weights and both moments back to the host
                for j, p in enumerate(params):
                    st = self.opt_one[k].state[p]
                    for m, t in enumerate((p, st["exp_avg"], st["exp_avg_sq"])):
                        self.host[k][3 * j + m].copy_(t, non_blocking=True)
            _sync(self.device)
            offset += n

    def resident(self, *, grouped: bool) -> None:
        for s, e in _chunks(sum(self.tokens), self.micro):
            self._pass(s, e, grouped=grouped)
        self.opt_groups.step()
        self.opt_groups.zero_grad(set_to_none=True)


def kernel_difference(stack: Stack, x: torch.Tensor, slot_of_token: torch.Tensor, slots: int) -> tuple[float, float]:
    """Largest differences between the loop and grouped kernels: of one forward's output and of every slot
    parameter's gradient, each relative to its largest magnitude."""
    r = SlotRouting.from_tokens(slot_of_token, slots)
    params = [p for k in range(slots) for p in stack.slot_params(k)]
    outs, grads = [], []
    for grouped in (False, True):
        out = stack.forward(x, r, grouped=grouped)
        out.float().square().mean().backward()
        outs.append(out.detach().float())
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]).float())
        for p in params:
            p.grad = None

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))

    return rel(*outs), rel(*grads)


def kernel_error(
    x: torch.Tensor,
    slot_of_token: torch.Tensor,
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
) -> dict[str, float]:
    """Each kernel's largest error against an fp32 reference, for one LoRA linear, relative to the largest output."""
    r = SlotRouting.from_tokens(slot_of_token, len(a))
    with torch.no_grad():
        ref = (
            torch.stack(
                [b[k].float() @ (a[k].to(x.dtype).float() @ x[t].float()) for t, k in enumerate(slot_of_token.tolist())]
            )
            if x.shape[0] <= 4096
            else None
        )
        if ref is None:  # per slot in fp32, the same formula
            ref = torch.cat(
                [
                    (seg.float() @ wa.to(x.dtype).float().t()) @ wb.to(x.dtype).float().t()
                    for seg, wa, wb in zip(x.split(list(r.counts)), a, b, strict=True)
                ]
            )
        scale = ref.abs().max().clamp_min(1e-12)
        return {
            name: float((lora_delta(x, r, a, b, 1.0, grouped=g).float() - ref).abs().max() / scale)
            for name, g in (("loop", False), ("grouped", True))
        }


# --- op counts ----------------------------------------------------------------------------------------------------

#: ops that allocate without writing (no kernel on a GPU)
_ALLOC_ONLY = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


@dataclasses.dataclass
class OpCount:
    """Kernels one phase dispatched: how many, how many wrote an activation-sized tensor, and the bytes written."""

    ops: int = 0
    full_ops: int = 0
    bytes: int = 0
    names: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class _Counter(TorchDispatchMode):
    """Counts the aten ops that run a kernel and the bytes of what they write (a view or a bare allocation runs
    none); a written tensor is activation-sized when one of its dims is the micro-batch's ``tokens`` and it holds at
    least 128 elements per token (a rank-wide ``x A^T`` does not)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.phase = OpCount()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _ALLOC_ONLY or name in ("_unsafe_view", "detach", "alias", "lift_fresh"):
            return out
        written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in written)
        self.phase.ops += 1
        self.phase.full_ops += int(any(self.tokens in t.shape and t.numel() >= 128 * self.tokens for t in written))
        self.phase.bytes += nbytes
        self.phase.names[name] += 1
        return out


def _meta_routing(r: SlotRouting) -> SlotRouting:
    """``r`` with its tensors on the meta device (on a GPU the routing is built where the activations are)."""
    return dataclasses.replace(
        r,
        **{
            f.name: getattr(r, f.name).to("meta")
            for f in dataclasses.fields(r)
            if isinstance(getattr(r, f.name), torch.Tensor)
        },
    )


@contextlib.contextmanager
def _kernel(grouped: bool) -> Iterator[None]:
    """The resident hook picks the grouped kernel on a Hopper GPU; on meta tensors it is told which to count."""
    saved = resident.grouped_mm_available
    resident.grouped_mm_available = lambda x: grouped
    try:
        yield
    finally:
        resident.grouped_mm_available = saved


def count_layer_ops(
    arm: str,
    *,
    slots: int = 1,
    interleaved: bool = False,
    tokens: int = 16384,
    rank: int = 16,
    dims: dict[str, int] | None = None,
    grouped: bool = True,
    row_tokens: int = 512,
) -> tuple[OpCount, OpCount]:
    """(forward, backward) kernels of one decoder layer's seven LoRA linears for one micro-batch of ``tokens``.

    ``arm``: ``base`` (the frozen linears alone), ``bank`` (the lean forward: ``addmm(base(x), x A^T, B^T,
    alpha=s)`` with bf16 weights, as FSDP's mixed precision hands them over) or ``resident`` (the forward hook with
    ``slots`` fp32 slots present, each on ``tokens / slots`` tokens in rows of ``row_tokens``: slot after slot, or
    the rows' slots interleaved). Every weight already holds a gradient, as from an earlier micro-batch, so the
    backward includes the accumulation a later micro-batch pays.
    """
    dims = dims or QWEN_1_5B
    h, i, kv = dims["hidden"], dims["intermediate"], dims["kv"]
    shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    meta, bf16 = "meta", torch.bfloat16
    scaling = 2.0
    # interleaved: at least two rows per slot, so that each slot's tokens are split
    n_rows = max(1, tokens // row_tokens, 2 * slots if interleaved else 1)
    row_slots = [j * slots // n_rows for j in range(n_rows)] if not interleaved else [j % slots for j in range(n_rows)]
    lengths = [tokens // n_rows + (1 if j < tokens % n_rows else 0) for j in range(n_rows)]
    r = _meta_routing(SlotRouting.from_rows(row_slots, lengths, slots))

    def leaf(*shape, dtype=bf16):
        t = torch.empty(*shape, device=meta, dtype=dtype, requires_grad=True)
        t.grad = torch.empty_like(t)  # an earlier micro-batch's: the backward accumulates
        return t

    layers = {}
    for name, (fan_in, fan_out) in shapes.items():
        base = torch.empty(fan_out, fan_in, device=meta, dtype=bf16)
        if arm == "bank":
            layers[name] = (base, leaf(rank, fan_in), leaf(fan_out, rank))
        elif arm == "resident":
            layers[name] = (
                base,
                types.SimpleNamespace(
                    lora_slots_A=[leaf(rank, fan_in, dtype=torch.float32) for _ in range(slots)],
                    lora_slots_B=[leaf(fan_out, rank, dtype=torch.float32) for _ in range(slots)],
                    lora_slots_scaling=scaling,
                ),
            )
        elif arm == "base":
            layers[name] = (base,)
        else:
            raise ValueError(f"unknown arm {arm!r}")

    def lin(name: str, x: torch.Tensor) -> torch.Tensor:
        base, *lora = layers[name]
        out = torch.nn.functional.linear(x, base)
        if arm == "bank":  # lora_forward.lean_lora_forward's short path
            a, b = lora
            xa = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), a)
            return torch.addmm(out.reshape(-1, out.shape[-1]), xa, b.t(), alpha=scaling).view(out.shape)
        if arm == "resident":
            return resident._resident_hook(lora[0], (x,), out)
        return out

    # the layer's four distinct inputs, as the hidden states that reach them (they require grad)
    x_attn, attn_out, x_mlp = (torch.empty(1, tokens, h, device=meta, dtype=bf16, requires_grad=True) for _ in range(3))
    mid = torch.empty(1, tokens, i, device=meta, dtype=bf16, requires_grad=True)
    counter = _Counter(tokens)
    with _kernel(grouped), resident.routing(r if arm == "resident" else None), counter:
        outs = [lin(n, x_attn) for n in ("q", "k", "v")] + [lin("o", attn_out)]
        outs += [lin(n, x_mlp) for n in ("gate", "up")] + [lin("down", mid)]
        fwd, counter.phase = counter.phase, OpCount()
        grads = [torch.empty(o.shape, device=meta, dtype=o.dtype) for o in outs]  # dense, as a real upstream grad
        torch.autograd.backward(outs, grads)
        bwd = counter.phase
    return fwd, bwd


def print_op_counts(*, tokens: int, rank: int, grouped: bool, verbose: bool = False) -> list[dict]:
    """The table of ``--count-ops``; returns its rows."""
    rows = []
    arms = (
        [("base", 1, False), ("bank", 1, False)]
        + [("resident", n, False) for n in (1, 8, 16)]
        + [("resident", n, True) for n in (8, 16)]
    )
    for arm, n, inter in arms:
        fwd, bwd = count_layer_ops(arm, slots=n, interleaved=inter, tokens=tokens, rank=rank, grouped=grouped)
        rows.append({"arm": arm, "slots": n if arm == "resident" else 1, "interleaved": inter, "fwd": fwd, "bwd": bwd})
    base = rows[0]
    mib = 2**20
    print(
        f"op counts: one decoder layer's 7 LoRA linears per micro-batch, {tokens} tokens, "
        f"dims {QWEN_1_5B}, rank {rank}, bf16 activations, {'grouped' if grouped else 'loop'} kernel; "
        f"kernels = aten ops that write (views and bare allocations excluded), full = writing a tokens x >= 128 "
        f"tensor; LoRA = minus the base linears; gradient checkpointing runs the forward twice"
    )
    print(
        f"  {'arm':28s} {'fwd ops':>8s} {'bwd ops':>8s} {'full fwd':>9s} {'full bwd':>9s} {'MiB fwd':>9s} "
        f"{'MiB bwd':>9s} {'LoRA ops':>9s} {'LoRA MiB':>9s}"
    )
    for row in rows:
        fwd, bwd = row["fwd"], row["bwd"]
        label = row["arm"]
        if label == "resident":
            plural = "s" if row["slots"] > 1 else ""
            label = f"resident {row['slots']} slot{plural}{' interleaved' if row['interleaved'] else ''}"
        lora_ops = fwd.ops + bwd.ops - base["fwd"].ops - base["bwd"].ops
        lora_mib = (fwd.bytes + bwd.bytes - base["fwd"].bytes - base["bwd"].bytes) / mib
        print(
            f"  {label:28s} {fwd.ops:8d} {bwd.ops:8d} {fwd.full_ops:9d} {bwd.full_ops:9d} {fwd.bytes / mib:9.0f} "
            f"{bwd.bytes / mib:9.0f} {lora_ops:9d} {lora_mib:9.0f}"
        )
        if verbose:
            for phase, c in (("fwd", fwd), ("bwd", bwd)):
                print(
                    f"      {phase}: "
                    + ", ".join(f"{k} {v}" for k, v in sorted(c.names.items(), key=lambda kv: -kv[1]))
                )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.bench.resident_lora", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument(
        "--tokens",
        default=None,
        help="tokens per adapter, TOKENS[xCOUNT],... (default: 10000x4,30000x4 on cuda, 96x2,160x2 on cpu)",
    )
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank (default: 64, the recipes')")
    ap.add_argument(
        "--scale", type=int, default=None, help="divide every width by this (default: 1 on cuda, 64 on cpu)"
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 28 on cuda, 2 on cpu)")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="tokens per micro-batch (default: 16384)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds after one warm-up (default: 5)")
    ap.add_argument(
        "--count-ops",
        action="store_true",
        help="count kernels and bytes written per micro-batch at full size on meta tensors (no timing)",
    )
    ap.add_argument(
        "--kernel",
        choices=("grouped", "loop"),
        default="grouped",
        help="--count-ops: the resident kernel to count (default: grouped, a Hopper GPU's)",
    )
    ap.add_argument("--verbose", action="store_true", help="--count-ops: each arm's ops by name")
    args = ap.parse_args(argv)
    if args.count_ops:
        print_op_counts(
            tokens=args.micro_tokens, rank=args.rank, grouped=args.kernel == "grouped", verbose=args.verbose
        )
        return 0
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    tokens = parse_tokens(args.tokens or ("10000x4,30000x4" if cuda else "96x2,160x2"))
    scale = args.scale or (1 if cuda else 64)
    dims = {k: max(16, v // scale) for k, v in QWEN_1_5B.items() if k != "layers"}
    dims["layers"] = args.layers or (28 if cuda else 2)
    rank = min(args.rank, dims["hidden"])
    stack = Stack(len(tokens), rank, dims, args.device)
    arm = Arm(stack, tokens, args.micro_tokens, args.device, seed=1)
    arms = [a for a in ARMS if a != "resident_grouped" or grouped_mm_available(arm.x)]
    run = {
        "bank": arm.bank,
        "resident_loop": lambda: arm.resident(grouped=False),
        "resident_grouped": lambda: arm.resident(grouped=True),
    }
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"resident_lora: {where}, {len(tokens)} adapters, tokens {tokens}, rank {rank}, dims {dims}, "
        f"micro-batch {args.micro_tokens} tokens, torch {torch.__version__}"
    )
    if "resident_grouped" in arms:
        # one micro-batch's worth of tokens drawn across every adapter, still sorted by adapter
        pick = torch.linspace(0, arm.x.shape[0] - 1, min(args.micro_tokens, arm.x.shape[0]), device=arm.x.device).long()
        out_diff, grad_diff = kernel_difference(stack, arm.x[pick], arm.slot_of_token[pick], len(tokens))
        print(f"loop vs grouped kernel, largest relative difference: output {out_diff:.2e}, gradients {grad_diff:.2e}")
        _, a, b = stack.layers[0]["gate"]
        err = kernel_error(
            arm.x[pick], arm.slot_of_token[pick], [w.to(torch.bfloat16) for w in a], [w.to(torch.bfloat16) for w in b]
        )
        print("one LoRA linear against fp32: " + ", ".join(f"{k} {v:.2e}" for k, v in err.items()))
    else:
        print("resident_grouped skipped: torch._grouped_mm needs bf16 on a CUDA GPU of compute capability 9.0+")
    times: dict[str, list[float]] = {a: [] for a in arms}
    for rnd in range(args.rounds + 1):
        for a in arms if rnd % 2 == 0 else arms[::-1]:  # interleaved, alternating order
            _sync(args.device)
            t0 = time.perf_counter()
            run[a]()
            _sync(args.device)
            if rnd:  # round 0 warms up
                times[a].append(time.perf_counter() - t0)
    if cuda:
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    base = statistics.median(times["bank"])
    for a in arms:
        t = times[a]
        med = statistics.median(t)
        print(
            f"  {a:17s} median {med * 1e3:9.1f} ms  spread {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} ms  "
            f"ratio to bank {med / base:.2f}  (n={len(t)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
