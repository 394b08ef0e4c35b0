"""One evolution event at Qwen2.5-Coder-7B LoRA shapes on the CPU: where its seconds go, per phase.

    python -m populora_verl.bench.evolution_event [--rounds 5] [--layers 28] [--rank 16] [--slots 8]
        [--layout bank|resident] [--ranks 4] [--modes driver workers] [--device cpu|cuda] [--fsdp]

The event makes two children, as the 4-GPU run's did: ``svd_mutation`` of slot 0 into slot ``slots-2`` (fresh
optimizer) and ``layer_crossover`` of slots 1 and 2 into slot ``slots-1`` (keeping slot 1's optimizer state, so both
optimizer paths are timed). The store holds ``--slots`` adapters with non-zero fp32 factors (verl keeps LoRA
parameters in fp32) and AdamW moments, on a stand-in model that has only the LoRA factors of the 7B's 196 linears
(its base weights would not fit), unsharded, or with ``--fsdp`` wrapped by FSDP2 on a one-rank group (the slots then
hold DTensor shards and every read is a gather, as under verl): one process plays one rank. ``--device cuda`` puts
the model on the GPU (the bank's slot copies stay on the host, pinned, as in the trainer).

Two ways to run the event, timed by phase (gather, operator, scatter, optimizer):

* ``driver``: the trainer's former path. Each parent is read from the store as full CPU tensors and pickled to the
  driver (what a Ray return costs, without the object store's own copy); the driver clones the parents and runs the
  operator on one thread (verl's TaskRunner is a one-CPU Ray actor); each child is pickled once per rank (a
  ``ONE_TO_ALL`` call serialises its argument for every worker, ``--ranks`` of them) and unpickled and written on
  one rank.
* ``workers``: the workers' path (``store.apply_plan``): every rank reads the parents where the slots live, runs the
  operator there and writes its share of the child, with nothing crossing a process.

Rounds alternate the order of the modes; the table gives the median and the range over rounds. The CPU shows the
data movement and the host work; a GPU's operators take milliseconds (``python -m populora_verl.bench.operators``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import statistics
import sys
import time
from collections.abc import Iterator, Mapping

import torch

from populora_verl.bench.operators import QWEN25_CODER_7B, ModelShape

__all__ = ["PHASES", "lora_only_model", "make_store", "event_plan", "run_driver", "run_workers", "run", "main"]

PHASES = ("gather", "operator", "scatter", "optimizer")


class _LoRALinear(torch.nn.Module):
    """A PEFT LoRA linear's adapter half: ``lora_A``/``lora_B`` module dicts, no base weight."""

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.base_layer = torch.nn.Identity()
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d_in, rank, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(rank, d_out, bias=False)})
        self.scaling = {"default": 1.0}


def lora_only_model(shape: ModelShape, rank: int) -> torch.nn.Module:
    """``layers.{i}.{self_attn,mlp}.{proj}.lora_{A,B}.default.weight`` at ``shape``, as PEFT names them."""
    layers = torch.nn.ModuleList()
    for _ in range(shape.layers):
        layer = torch.nn.Module()
        for name, (d_in, d_out) in shape.modules().items():
            block, proj = name.split(".")
            if not hasattr(layer, block):
                layer.add_module(block, torch.nn.Module())
            getattr(layer, block).add_module(proj, _LoRALinear(d_in, d_out, rank))
        layers.append(layer)
    model = torch.nn.Module()
    model.layers = layers
    return model


def make_store(
    layout: str,
    shape: ModelShape,
    rank: int,
    num_slots: int,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    fsdp: bool = False,
) -> object:
    """A bank or resident store of ``num_slots`` trained-looking adapters (non-zero B, one AdamW step each)."""
    from populora_verl.workers.adapter_bank import AdapterBank
    from populora_verl.workers.resident import ResidentAdapters

    device = torch.device(device)
    model = lora_only_model(shape, rank).to(device)
    if fsdp:
        _fully_shard(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = AdapterBank(model, opt) if layout == "bank" else ResidentAdapters(model, opt)
    store.init_slots(num_slots, seed=seed)
    g = torch.Generator().manual_seed(seed)
    shapes = {k: tuple(v.shape) for k, v in store.get_adapter_state(0).items()}
    for k in range(num_slots):
        state = {
            key: torch.randn(s, generator=g) * (0.01 if ".lora_B." in key else s[-1] ** -0.5)
            for key, s in shapes.items()
        }
        store.set_adapter_state(k, state, reset_optimizer=True)
        _one_adamw_step(store, k)
    return store


def _fully_shard(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 per layer and on the root, on a one-rank group (NCCL on CUDA, gloo on the CPU), as verl wraps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _one_adamw_step(store: object, slot: int) -> None:
    """Give ``slot`` optimizer moments (the children copy or drop them)."""
    if getattr(store, "layout", "bank") == "resident":
        for p in store.slot_parameters(slot):
            p.grad = torch.full_like(p, 1e-3)
        store.optimizer.step()
        store.zero_grad()
        return
    with store.active(slot, train=True):
        for p in store._params.values():
            p.grad = torch.full_like(p, 1e-3)
        store.optimizer.step()
        store.optimizer.zero_grad(set_to_none=True)


def event_plan(num_slots: int) -> list[dict]:
    """Two children: an SVD mutation with a fresh optimizer and a layer crossover keeping its fitter parent's."""
    return [
        {"child_slot": num_slots - 2, "operator": "svd_mutation", "parent_slots": [0], "seed": 11},
        {
            "child_slot": num_slots - 1,
            "operator": "layer_crossover",
            "parent_slots": [1, 2],
            "seed": 12,
            "reset_optimizer": False,
        },
    ]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ray_hop(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return pickle.loads(pickle.dumps(dict(state), protocol=5))


def run_driver(store: object, plan: list[dict], ranks: int) -> dict[str, float]:
    """The trainer's former path: parents to the driver, operators there, each child to every rank."""
    from populora_verl.evolution.operators import OPERATORS
    from populora_verl.workers.adapter_bank import timed_phase

    split: dict[str, float] = {}
    parents: dict[int, dict[str, torch.Tensor]] = {}
    children = []
    for e in plan:
        with timed_phase(split, "gather"):
            for ps in e["parent_slots"]:
                if ps not in parents:
                    parents[ps] = _ray_hop(store.get_adapter_state(ps))
        with timed_phase(split, "operator"), _threads(1):
            copies = [{k: v.detach().clone() for k, v in parents[ps].items()} for ps in e["parent_slots"]]
            gen = torch.Generator(device="cpu").manual_seed(e["seed"])
            children.append(OPERATORS[e["operator"]](copies, generator=gen))
    for e, child in zip(plan, children):
        reset = bool(e.get("reset_optimizer", True))
        with timed_phase(split, "scatter"):
            with _threads(1):
                blobs = [pickle.dumps(child, protocol=5) for _ in range(ranks)]
            store.set_adapter_state(e["child_slot"], pickle.loads(blobs[0]), reset_optimizer=reset)
        with timed_phase(split, "optimizer"):
            if not reset:
                store.copy_optimizer(e["parent_slots"][0], e["child_slot"])
    return split


def run_workers(store: object, plan: list[dict]) -> dict[str, float]:
    """The workers' path: ``store.apply_plan`` with its own per-phase timing."""
    split: dict[str, float] = {}
    store.apply_plan(plan, timing=split)
    return split


def run(
    layout: str = "bank",
    shape: ModelShape = QWEN25_CODER_7B,
    rank: int = 16,
    num_slots: int = 8,
    rounds: int = 5,
    ranks: int = 4,
    modes: tuple[str, ...] = ("driver", "workers"),
    log=print,
    *,
    device: str = "cpu",
    fsdp: bool = False,
) -> dict[str, list[dict[str, float]]]:
    """``{mode: [per-round {phase: s, "total": s}]}``; one warm-up event per mode first, untimed."""
    store = make_store(layout, shape, rank, num_slots, device=device, fsdp=fsdp)
    plan = event_plan(num_slots)
    fns = {"driver": lambda: run_driver(store, plan, ranks), "workers": lambda: run_workers(store, plan)}
    for m in modes:
        fns[m]()
    out: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for i in range(rounds):
        for m in modes if i % 2 == 0 else tuple(reversed(modes)):
            _sync()
            t0 = time.perf_counter()
            split = fns[m]()
            _sync()
            split["total"] = time.perf_counter() - t0
            out[m].append(split)
            log(f"  round {i + 1} {m:<8} " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    return out


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def format_table(results: Mapping[str, list[dict[str, float]]]) -> str:
    cols = (*PHASES, "total")
    lines = ["| path | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for mode, rows in results.items():
        cells = []
        for c in cols:
            vals = [r.get(c, 0.0) for r in rows]
            cells.append(f"{statistics.median(vals):.2f} [{min(vals):.2f}–{max(vals):.2f}]")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.bench.evolution_event", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=QWEN25_CODER_7B.layers)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4, help="workers a ONE_TO_ALL call serialises the child for")
    ap.add_argument("--layout", choices=["bank", "resident"], default="bank")
    ap.add_argument("--modes", nargs="+", choices=["driver", "workers"], default=["driver", "workers"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on a one-rank group: DTensor shards, gathers")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    if args.rounds < 1 or args.slots < 5 or args.layers < 1 or args.rank < 1 or args.ranks < 1:
        ap.error("--rounds, --layers, --rank and --ranks must be >= 1 and --slots >= 5")
    shape = ModelShape(args.layers, QWEN25_CODER_7B.hidden, QWEN25_CODER_7B.intermediate, QWEN25_CODER_7B.kv_out)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    desc = (
        f"{args.layout} layout{' under FSDP2 (1 rank)' if args.fsdp else ''}, {shape.layers} layers x 7 modules, "
        f"rank {args.rank}, {args.slots} slots, device {args.device}{gpu}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads, load {load:.2f}, torch {torch.__version__}"
    )
    print(desc, flush=True)
    results = run(
        args.layout,
        shape,
        args.rank,
        args.slots,
        args.rounds,
        args.ranks,
        tuple(args.modes),
        device=args.device,
        fsdp=args.fsdp,
    )
    print(f"\nOne evolution event (2 children), seconds, median [min–max] of {args.rounds} rounds\n{desc}\n")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
