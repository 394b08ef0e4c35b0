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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from populora_verl.workers.resident import SlotRouting, grouped_mm_available, lora_delta

__all__ = ["Stack", "parse_tokens", "main"]

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
        self.shapes = [("q", h, h), ("k", h, kv), ("v", h, kv), ("o", h, h), ("gate", h, i), ("up", h, i),
                       ("down", i, h)]
        self.layers = []
        for _ in range(dims["layers"]):
            layer = {}
            for name, fan_in, fan_out in self.shapes:
                base = (torch.randn(fan_out, fan_in, generator=gen) / fan_in ** 0.5).to(device, torch.bfloat16)
                a = [torch.nn.Parameter((torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(device))
                     for _ in range(slots)]
                b = [torch.nn.Parameter((torch.randn(fan_out, rank, generator=gen) * 1e-3).to(device))
                     for _ in range(slots)]
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
            return inp @ base.t() + lora_delta(inp, r, a, b, self.scaling, grouped=grouped)

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
        self.opt_groups = torch.optim.AdamW([{"params": stack.slot_params(k)} for k in range(n)], lr=1e-6,
                                            weight_decay=0.01, foreach=True)
        self.opt_one = [torch.optim.AdamW(stack.slot_params(k), lr=1e-6, weight_decay=0.01, foreach=True)
                        for k in range(n)]
        # the bank's host copies: each adapter's weights and two moments, pinned where a GPU is
        pin = device.startswith("cuda")
        self.host = [[torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in stack.slot_params(k) for _ in range(3)]
                     for k in range(n)]

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


def kernel_error(x: torch.Tensor, slot_of_token: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                 ) -> dict[str, float]:
    """Each kernel's largest error against an fp32 reference, for one LoRA linear, relative to the largest output."""
    r = SlotRouting.from_tokens(slot_of_token, len(a))
    with torch.no_grad():
        ref = torch.stack([b[k].float() @ (a[k].to(x.dtype).float() @ x[t].float())
                           for t, k in enumerate(slot_of_token.tolist())]) if x.shape[0] <= 4096 else None
        if ref is None:  # per slot in fp32, the same formula
            ref = torch.cat([(seg.float() @ wa.to(x.dtype).float().t()) @ wb.to(x.dtype).float().t()
                             for seg, wa, wb in zip(x.split(list(r.counts)), a, b, strict=True)])
        scale = ref.abs().max().clamp_min(1e-12)
        return {name: float((lora_delta(x, r, a, b, 1.0, grouped=g).float() - ref).abs().max() / scale)
                for name, g in (("loop", False), ("grouped", True))}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.bench.resident_lora", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--tokens", default=None,
                    help="tokens per adapter, TOKENS[xCOUNT],... (default: 10000x4,30000x4 on cuda, 96x2,160x2 on cpu)")
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank (default: 64, the recipes')")
    ap.add_argument("--scale", type=int, default=None, help="divide every width by this (default: 1 on cuda, 64 on cpu)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 28 on cuda, 2 on cpu)")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="tokens per micro-batch (default: 16384)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds after one warm-up (default: 5)")
    args = ap.parse_args(argv)
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
    run = {"bank": arm.bank, "resident_loop": lambda: arm.resident(grouped=False),
           "resident_grouped": lambda: arm.resident(grouped=True)}
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"resident_lora: {where}, {len(tokens)} adapters, tokens {tokens}, rank {rank}, dims {dims}, "
          f"micro-batch {args.micro_tokens} tokens, torch {torch.__version__}")
    if "resident_grouped" in arms:
        # one micro-batch's worth of tokens drawn across every adapter, still sorted by adapter
        pick = torch.linspace(0, arm.x.shape[0] - 1, min(args.micro_tokens, arm.x.shape[0]), device=arm.x.device).long()
        out_diff, grad_diff = kernel_difference(stack, arm.x[pick], arm.slot_of_token[pick], len(tokens))
        print(f"loop vs grouped kernel, largest relative difference: output {out_diff:.2e}, gradients {grad_diff:.2e}")
        _, a, b = stack.layers[0]["gate"]
        err = kernel_error(arm.x[pick], arm.slot_of_token[pick], [w.to(torch.bfloat16) for w in a],
                           [w.to(torch.bfloat16) for w in b])
        print("one LoRA linear against fp32: " + ", ".join(f"{k} {v:.2e}" for k, v in err.items()))
    else:
        print("resident_grouped skipped: torch._grouped_mm needs bf16 on a CUDA GPU of compute capability 9.0+")
    times: dict[str, list[float]] = {a: [] for a in arms}
    for rnd in range(args.rounds + 1):
        for a in (arms if rnd % 2 == 0 else arms[::-1]):  # interleaved, alternating order
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
        print(f"  {a:17s} median {med * 1e3:9.1f} ms  spread {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} ms  "
              f"ratio to bank {med / base:.2f}  (n={len(t)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
