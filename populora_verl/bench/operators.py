"""Operator benchmark: wall time per child on adapters shaped like Qwen2.5-Coder-7B.

    python -m populora_verl.bench.operators [--device cpu|cuda] [--ranks 16 64] [--repeats N] [--out FILE.md]

Adapters: 28 layers x {q, k, v, o, gate, up, down}, hidden 3584, intermediate 18944, 4 KV heads of dim 128
(k/v out = 512), bf16, A ~ U(±1/sqrt(in)) (PEFT's Kaiming bound) and B ~ N(0, 0.01^2) (non-zero, as after
training). Each operator is timed end to end on state dicts (stacking, fp32 math, cast back), median over
``--repeats`` after ``--warmup`` calls, with ``torch.cuda.synchronize()`` around each call on GPU. Goal: every
operator <= 100 ms per child at rank 64 on one H100.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from populora_verl.evolution.operators import OPERATORS

__all__ = ["ModelShape", "QWEN25_CODER_7B", "make_adapter", "time_operator", "run", "main"]


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    kv_out: int  # num_key_value_heads * head_dim

    def modules(self) -> dict[str, tuple[int, int]]:
        """Target module -> (in, out)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_out
        return {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (h, kv),
            "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (h, i),
            "mlp.up_proj": (h, i),
            "mlp.down_proj": (i, h),
        }


QWEN25_CODER_7B = ModelShape(layers=28, hidden=3584, intermediate=18944, kv_out=4 * 128)


def make_adapter(
    shape: ModelShape,
    rank: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A random PEFT-style LoRA state dict with non-zero B."""
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for layer in range(shape.layers):
        for name, (d_in, d_out) in shape.modules().items():
            p = f"base_model.model.model.layers.{layer}.{name}"
            a = (torch.rand(rank, d_in, generator=g, device=device) * 2 - 1) / math.sqrt(d_in)
            b = torch.randn(d_out, rank, generator=g, device=device) * 0.01
            sd[p + ".lora_A.weight"], sd[p + ".lora_B.weight"] = a.to(dtype), b.to(dtype)
    return sd


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_operator(
    name: str, parents: list[dict[str, torch.Tensor]], *, repeats: int, warmup: int, seed: int = 0
) -> list[float]:
    """Seconds per call of ``OPERATORS[name]`` (after ``warmup`` untimed calls)."""
    op = OPERATORS[name]
    device = next(iter(parents[0].values())).device
    g = torch.Generator(device=device).manual_seed(seed)
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        child = op(parents[: op.num_parents], generator=g)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        del child
    return times


def machine_description(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [f"CPU: {cpu} ({torch.get_num_threads()} torch threads)"]
    if device.type == "cuda":
        parts.append(f"GPU: {torch.cuda.get_device_name(device)}")
    parts.append(f"torch {torch.__version__}, Python {platform.python_version()}")
    return "; ".join(parts)


def run(
    device: str = "cpu",
    ranks: tuple[int, ...] = (16, 64),
    repeats: int = 3,
    warmup: int = 1,
    operators: list[str] | None = None,
    shape: ModelShape = QWEN25_CODER_7B,
    log=print,
) -> list[dict]:
    from tqdm.auto import tqdm

    dev = torch.device(device)
    names = operators or list(OPERATORS)
    rows = []
    bar = tqdm(total=len(ranks) * len(names), desc="operators", unit="op", disable=None)
    if not bar.disable:
        log = bar.write  # keep the per-operator lines above the bar
    for rank in ranks:
        parents = [make_adapter(shape, rank, device=dev, seed=s) for s in (0, 1)]
        n_params = sum(v.numel() for v in parents[0].values())
        log(f"# rank {rank}: {len(parents[0]) // 2} modules, {n_params / 1e6:.1f}M params per adapter")
        for name in names:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times = time_operator(name, parents, repeats=repeats, warmup=warmup)
            row = {
                "operator": name,
                "kind": OPERATORS[name].kind,
                "rank": rank,
                "ms": 1000 * statistics.median(times),
                "min_ms": 1000 * min(times),
            }
            if dev.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            rows.append(row)
            log(f"  {name:<24} {row['ms']:10.1f} ms/child")
            bar.update(1)
        del parents
    bar.close()
    return rows


def format_table(rows: list[dict]) -> str:
    gpu = any("peak_gib" in r for r in rows)
    head = ["operator", "kind", "rank", "ms/child (median)", "min ms"] + (["peak GiB"] if gpu else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["operator"], r["kind"], str(r["rank"]), f"{r['ms']:.1f}", f"{r['min_ms']:.1f}"]
        if gpu:
            cells.append(f"{r['peak_gib']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.bench.operators", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--operators", nargs="+", default=None, help=f"subset of {list(OPERATORS)}")
    ap.add_argument("--layers", type=int, default=QWEN25_CODER_7B.layers, help="fewer layers for a quick look")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    if args.repeats < 1 or args.warmup < 0 or any(r < 1 for r in args.ranks):
        ap.error("--repeats must be >= 1, --warmup >= 0 and ranks >= 1")
    for name in args.operators or []:
        if name not in OPERATORS:
            ap.error(f"unknown operator {name!r}; known: {list(OPERATORS)}")
    shape = ModelShape(args.layers, QWEN25_CODER_7B.hidden, QWEN25_CODER_7B.intermediate, QWEN25_CODER_7B.kv_out)
    desc = machine_description(torch.device(args.device))
    print(desc, flush=True)
    rows = run(
        args.device,
        tuple(args.ranks),
        args.repeats,
        args.warmup,
        args.operators,
        shape,
        log=lambda s: print(s, flush=True),
    )
    table = format_table(rows)
    title = (
        f"Operators on Qwen2.5-Coder-7B-shaped bf16 adapters ({shape.layers} layers x 7 modules), "
        f"device {args.device}, median of {args.repeats} after {args.warmup} warm-up"
    )
    print(f"\n{title}\n{desc}\n\n{table}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{title}.\n\n{desc}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
