"""The adapter bank's swaps under FSDP2: milliseconds to load a slot into the live adapter and to write it back.

Why: verl's torch profile of a 4T4S step of Qwen2.5-Coder-1.5B (BENCHMARKS.md §5, 4 x H200) put 1.6 s of that step
in the bank's swaps with the GPU idle: every swap is about 1,200 small copies of weights and AdamW moments between
the GPU and pinned host memory, 392 LoRA tensors each. This times the swaps on a model's LoRA shapes, sharded as
FSDP2 shards them (``Shard(0)`` DTensors on a one-rank mesh), with the optimizer state a trained slot carries:

    python -m populora_verl.bench.bank_swap                        # CPU, Qwen2.5-1.5B's LoRA shapes at r=16
    python -m populora_verl.bench.bank_swap --device cuda --rounds 9

Each round swaps every slot in turn (in, then out as after a training call). On a CPU the copies are host memory
copies and the figure is mostly per-tensor host overhead; ``--scale`` divides every width to leave only that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from populora_verl.bench.optimizer_step import QWEN_1_5B, _sync, add_lora_arguments, init_one_rank, lora_shapes

__all__ = ["lora_module", "measure", "main"]

_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_module(shapes: Sequence[tuple[int, int]], mesh, device: str, seed: int = 0) -> torch.nn.Module:
    """A module whose parameters carry PEFT's LoRA names (``layers.L.<proj>.lora_A.default.weight``) and the given
    shapes, in :func:`~populora_verl.bench.optimizer_step.lora_shapes` order, as ``Shard(0)`` DTensors on ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    root = torch.nn.Module()
    pairs = list(zip(shapes[0::2], shapes[1::2], strict=True))
    for i, (a_shape, b_shape) in enumerate(pairs):
        layer, proj = divmod(i, len(_MODULES))
        owner = root
        for part in ("layers", str(layer), _MODULES[proj]):
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        for which, shape in (("lora_A", a_shape), ("lora_B", b_shape)):
            holder = torch.nn.Module()
            owner.add_module(which, holder)
            sub = torch.nn.Module()
            holder.add_module("default", sub)
            full = torch.randn(*shape, generator=gen).to(device)
            sub.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    return root


def measure(
    shapes: Sequence[tuple[int, int]], *, device: str = "cpu", slots: int = 4, rounds: int = 5
) -> dict[str, list[float]]:
    """Milliseconds per ``swap_in`` and per ``swap_out`` of a trained slot, one entry per round (each the mean over
    the slots). Needs an initialised process group (see :func:`main`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from populora_verl.workers.adapter_bank import AdapterBank

    if slots < 2:
        raise ValueError(f"slots must be >= 2 (a swap to the active slot copies nothing), got {slots}")
    mesh = init_device_mesh(device.split(":")[0], (1,))
    model = lora_module(shapes, mesh, device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    bank = AdapterBank(model, opt)
    bank.init_slots(slots, seed=0)
    for k in range(slots):  # every slot gets AdamW moments, as after its first training call
        with bank.active(k):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    out: dict[str, list[float]] = {"swap_in_ms": [], "swap_out_ms": []}
    for _ in range(rounds):
        t_in = t_out = 0.0
        for k in range(slots):
            _sync(device)
            t0 = time.perf_counter()
            bank.swap_in(k)  # the previous slot is written back already: this is the load alone
            _sync(device)
            t1 = time.perf_counter()
            bank.swap_in(k, train=True)  # no copy: marks the live adapter changed, as a training call leaves it
            t2 = time.perf_counter()
            bank.swap_out()
            _sync(device)
            t_in, t_out = t_in + (t1 - t0), t_out + (time.perf_counter() - t2)
        out["swap_in_ms"].append(t_in / slots * 1e3)
        out["swap_out_ms"].append(t_out / slots * 1e3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lora_arguments(ap)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args(argv)
    if args.slots < 2:
        ap.error("--slots must be >= 2 (a swap to the active slot copies nothing)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bank_swap: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    import torch.distributed as dist

    init_one_rank(args.device)
    shapes = lora_shapes(args.rank, args.scale, QWEN_1_5B | {"layers": args.layers})
    res = measure(shapes, device=args.device, slots=args.slots, rounds=args.rounds)
    print(
        f"bank swaps of {len(shapes)} LoRA tensors (rank {args.rank}, widths / {args.scale}) with AdamW state, "
        f"{args.slots} slots, {args.rounds} rounds on {args.device}; load average {os.getloadavg()[0]:.1f}"
    )
    for what, vals in res.items():
        print(f"{what}: median {statistics.median(vals):.2f} (min {min(vals):.2f}, max {max(vals):.2f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
