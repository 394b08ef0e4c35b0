"""The optimizer step of one adapter under FSDP2: torch's AdamW implementations and the gradient clip side by side.

Why: every adapter's update pays a fixed cost besides its tokens. On 2 x H200 (BENCHMARKS.md §5) a 4T4S teacher's
update of about 10k tokens ran at 0.20 MFU and a student's of 30k at 0.36. The optimizer was a suspect: the update's
parameters are ~400 small DTensors (LoRA A and B of 7 modules x 28 layers for Qwen2.5-1.5B), verl's AdamW takes
torch's ``foreach`` path, which goes through DTensor's dispatch for each list op, and verl's torch profile of a 4T4S
step showed AdamW's step at 88 ms per adapter (under the profiler). ``fused=True`` runs one kernel per group.

This measures the step itself on the parameter shapes of a model's LoRA, sharded as FSDP2 shards them (``Shard(0)``
DTensors on a one-rank mesh), each implementation in turn, interleaved over rounds:

    python -m populora_verl.bench.optimizer_step                      # CPU, Qwen2.5-1.5B's LoRA shapes at r=16
    python -m populora_verl.bench.optimizer_step --device cuda --rounds 9

The dispatch overhead it shows on a CPU is host time that a GPU run pays too; the arithmetic differs (on a CPU the
18M parameters' arithmetic is itself milliseconds), so ``--scale 96`` divides every width to leave mostly the
overhead. verl takes an implementation from ``actor_rollout_ref.actor.optim.override_optimizer_config``
(``'{fused: true}'``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from populora_verl.bench.child import alternating

__all__ = ["lora_shapes", "IMPLS", "measure", "init_one_rank", "add_lora_arguments", "main"]

#: Qwen2.5-1.5B: hidden 1536, MLP 8960, 256-wide key/value projections (2 KV heads of 128)
QWEN_1_5B = {"layers": 28, "hidden": 1536, "intermediate": 8960, "kv": 256}
#: verl's AdamW (torch.optim.AdamW) with each of torch's implementations
IMPLS: dict[str, dict[str, bool]] = {
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}


def lora_shapes(rank: int, scale: int = 1, dims: dict[str, int] = QWEN_1_5B) -> list[tuple[int, int]]:
    """(rows, cols) of every LoRA A and B of a Qwen2 decoder stack with ``target_modules=all-linear``."""
    h, i, kv = (max(1, dims[k] // scale) for k in ("hidden", "intermediate", "kv"))
    modules = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (in, out)
    out = []
    for _ in range(dims["layers"]):
        for fan_in, fan_out in modules:
            out += [(rank, fan_in), (fan_out, rank)]  # A: r x in, B: out x r
    return out


def _params(shapes: Sequence[tuple[int, int]], mesh, device: str, seed: int) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    params = []
    for rows, cols in shapes:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(rows, cols, generator=gen).to(device), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(rows, cols, generator=gen).to(device), mesh, [Shard(0)])
        params.append(p)
    return params


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(
    shapes: Sequence[tuple[int, int]],
    *,
    device: str = "cpu",
    rounds: int = 5,
    steps: int = 5,
    impls: Sequence[str] = tuple(IMPLS),
) -> dict[str, dict[str, float]]:
    """Milliseconds per ``step()`` (and per ``clip_grad_norm_``) for each implementation, median and range over
    ``rounds``; also each implementation's largest difference from ``foreach`` after one step from the same state.
    Needs an initialised process group (see :func:`main`)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.split(":")[0], (1,))
    opts, params = {}, {}
    for name in impls:
        params[name] = _params(shapes, mesh, device, seed=0)  # the same start for every implementation
        opts[name] = torch.optim.AdamW(params[name], lr=1e-4, weight_decay=0.01, **IMPLS[name])
    first = {}
    for name in impls:  # one step each: the state exists afterwards, and the results can be compared
        opts[name].step()
        first[name] = [p.detach().to_local().clone() for p in params[name]]
    ref = first.get("foreach", next(iter(first.values())))
    times: dict[str, list[float]] = {n: [] for n in impls}
    clip: dict[str, list[float]] = {n: [] for n in impls}
    for _, name in alternating(list(impls), rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            opts[name].step()
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(steps):  # verl clips before every step: the same DTensor lists, other foreach ops
            torch.nn.utils.clip_grad_norm_(params[name], 1.0, foreach=name != "for-loop")
        _sync(device)
        times[name].append((t1 - t0) / steps * 1e3)
        clip[name].append((time.perf_counter() - t1) / steps * 1e3)
    out = {}
    for name in impls:
        diff = max(float((a - b).abs().max()) for a, b in zip(first[name], ref, strict=True))
        out[name] = {
            "step_ms": statistics.median(times[name]),
            "step_min": min(times[name]),
            "step_max": max(times[name]),
            "clip_ms": statistics.median(clip[name]),
            "max_diff_vs_foreach": diff,
        }
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_rank(device: str) -> bool:
    """A one-rank process group for ``device`` (nccl on a GPU, else gloo) unless one exists; True if started here.
    Through a TCP address rather than MASTER_ADDR/MASTER_PORT, so the caller's environment (and its children's)
    keeps no port of a group that is gone."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )
    return True


def add_lora_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark over one model's LoRA tensors on one rank: device, LoRA rank, width scale,
    layers, rounds (the shapes come from :func:`lora_shapes` with them)."""
    ap.add_argument("--device", default="cpu", help="cpu or cuda (one rank)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--scale", type=int, default=1, help="divide every width by this (keeps the tensor count)")
    ap.add_argument("--layers", type=int, default=QWEN_1_5B["layers"])
    ap.add_argument("--rounds", type=int, default=5)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lora_arguments(ap)
    ap.add_argument("--steps", type=int, default=5, help="steps timed per round")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {list(IMPLS)}")
    args = ap.parse_args(argv)
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    unknown = [x for x in impls if x not in IMPLS]
    if unknown or not impls:
        ap.error(f"--impls: unknown {unknown}; known: {list(IMPLS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("optimizer_step: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    import torch.distributed as dist

    init_one_rank(args.device)
    shapes = lora_shapes(args.rank, args.scale, QWEN_1_5B | {"layers": args.layers})
    n = sum(r * c for r, c in shapes)
    res = measure(shapes, device=args.device, rounds=args.rounds, steps=args.steps, impls=impls)
    base = res.get("foreach", {}).get("step_ms")
    print(
        f"AdamW step over {len(shapes)} LoRA tensors ({n / 1e6:.2f}M parameters, rank {args.rank}, widths / "
        f"{args.scale}) on {args.device}, {args.rounds} interleaved rounds of {args.steps} steps; load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print("| implementation | step ms, median | min-max | x foreach | clip_grad_norm_ ms | max diff vs foreach |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
        print(
            f"| {name} | {r['step_ms']:.2f} | {r['step_min']:.2f}-{r['step_max']:.2f} | {ratio} | "
            f"{r['clip_ms']:.2f} | {r['max_diff_vs_foreach']:.2e} |"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
