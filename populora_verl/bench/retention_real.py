"""Operator retention on a real model with really trained adapters (GPU machine; offline).

    source scripts/gpu/env.sh && python -m populora_verl.bench.retention_real --model "$MODEL_DIR" --out retention.md

1. Loads the base model (Qwen2.5-Coder-0.5B-Instruct by default, bf16 on CUDA) and puts one PEFT LoRA on it.
2. Trains three adapters with a short supervised fine-tune (AdamW, answer tokens only) on a fixed set of small
   Python tasks written for this bench, each adapter on its own third of the set:
   ``P0`` and ``P1`` start from one lora_A draw (related: the population's shared founder init, or PBT kin),
   ``P2`` from another (unrelated). lora_B starts at zero, as PEFT does, so training is what makes B non-zero.
3. For every registered operator at its default strength (plus a strength sweep of the mutations unless
   ``--no-sweep``) makes ``--children`` children and scores them right away.

**Score** (stated here so results can be compared): the per-token likelihood ``exp(mean log p)`` of a parent's own
training
answers (the tasks it was fine-tuned on) given their prompts; for a crossover, of the fitter parent ``parents[0]``.
``retention = child score / parent score``. The table also gives **gain kept**
``(log p_child - log p_base) / (log p_parent - log p_base)``: how much of what the fine-tune taught survives
(1 = all, 0 = back to the base model), the stricter of the two. Mutations are averaged over P0, P1, P2;
crossovers over the ordered pairs (P0, P1), (P1, P0) (related) and (P0, P2), (P2, P0) (unrelated).

On a CPU run (tests) pass a tiny model folder; every step is the same.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["TASKS", "SWEEP", "RetentionResult", "run", "main"]

# Small Python tasks (prompt, answer), written for this bench. Split in three: one third per adapter.
TASKS: tuple[tuple[str, str], ...] = (
    (
        "Write a Python function `f(xs)` that returns the sum of the even numbers in the list xs.",
        "def f(xs):\n    return sum(x for x in xs if x % 2 == 0)\n",
    ),
    ("Write a Python function `f(s)` that returns the string s reversed.", "def f(s):\n    return s[::-1]\n"),
    (
        "Write a Python function `f(n)` that returns the factorial of n.",
        "def f(n):\n    out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out\n",
    ),
    (
        "Write a Python function `f(words)` that returns the longest word of the list words.",
        "def f(words):\n    return max(words, key=len)\n",
    ),
    (
        "Write a Python function `f(d)` that returns the keys of the dict d whose value is positive, sorted.",
        "def f(d):\n    return sorted(k for k, v in d.items() if v > 0)\n",
    ),
    (
        "Write a Python function `f(a, b)` that returns the greatest common divisor of a and b.",
        "def f(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    ),
    (
        "Write a Python function `f(s)` that counts the vowels in the string s.",
        "def f(s):\n    return sum(ch in 'aeiou' for ch in s.lower())\n",
    ),
    (
        "Write a Python function `f(xs)` that returns xs without duplicates, keeping the first occurrence order.",
        "def f(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
        "            seen.add(x)\n            out.append(x)\n    return out\n",
    ),
    (
        "Write a Python function `f(m)` that returns the transpose of the matrix m given as a list of rows.",
        "def f(m):\n    return [list(col) for col in zip(*m)]\n",
    ),
    (
        "Write a Python function `f(n)` that returns True when n is a prime number.",
        "def f(n):\n    if n < 2:\n        return False\n    k = 2\n    while k * k <= n:\n"
        "        if n % k == 0:\n            return False\n        k += 1\n    return True\n",
    ),
    (
        "Write a Python function `f(s)` that returns True when the string s is a palindrome.",
        "def f(s):\n    return s == s[::-1]\n",
    ),
    (
        "Write a Python function `f(xs, k)` that rotates the list xs left by k positions.",
        "def f(xs, k):\n    if not xs:\n        return xs\n    k %= len(xs)\n    return xs[k:] + xs[:k]\n",
    ),
    (
        "Write a Python function `f(n)` that returns the list of the first n Fibonacci numbers.",
        "def f(n):\n    out = []\n    a, b = 0, 1\n    for _ in range(n):\n        out.append(a)\n"
        "        a, b = b, a + b\n    return out\n",
    ),
    (
        "Write a Python function `f(s)` that returns a dict counting each character of s.",
        "def f(s):\n    out = {}\n    for ch in s:\n        out[ch] = out.get(ch, 0) + 1\n    return out\n",
    ),
    (
        "Write a Python function `f(xs)` that returns the running maximum of the list xs.",
        "def f(xs):\n    out = []\n    best = None\n    for x in xs:\n"
        "        best = x if best is None else max(best, x)\n"
        "        out.append(best)\n    return out\n",
    ),
    (
        "Write a Python function `f(n)` that returns the sum of the digits of the integer n.",
        "def f(n):\n    return sum(int(c) for c in str(abs(n)))\n",
    ),
    (
        "Write a Python function `f(intervals)` that merges overlapping [start, end] intervals.",
        "def f(intervals):\n    out = []\n    for s, e in sorted(intervals):\n        if out and s <= out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], e)\n        else:\n            out.append([s, e])\n    return out\n",
    ),
    (
        "Write a Python function `f(s)` that returns the words of the sentence s in reverse order.",
        "def f(s):\n    return ' '.join(reversed(s.split()))\n",
    ),
)

# Strength sweep of the mutations (the defaults are always measured too).
SWEEP: tuple[tuple[str, dict[str, Any]], ...] = (
    ("svd_mutation", {"eps": 0.05}),
    ("svd_mutation", {"eps": 0.2}),
    ("layer_gaussian", {"eps": 0.3}),
    ("component_mask", {"rho": 0.1}),
    ("component_mask", {"rho": 0.3}),
    ("full_gaussian", {"eps": 0.05}),
    ("full_gaussian", {"eps": 0.3}),
    ("neftune", {"alpha": 0.3}),
    ("neftune", {"alpha": 3.0}),
    ("neftune", {"alpha": 10.0}),
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class RetentionResult:
    operator: str
    kind: str
    params: dict[str, Any]
    pair: str | None  # crossovers: related | unrelated
    retention: float  # mean child / parent per-token likelihood
    min_retention: float
    gain_kept: float  # mean (logp_child - logp_base) / (logp_parent - logp_base)
    delta_w_rel: float


def _encode(tok: Any, tasks: Sequence[tuple[str, str]], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer ids with labels on the answer tokens only."""
    rows = []
    for prompt, answer in tasks:
        p = tok(prompt + "\n", add_special_tokens=False)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + (
            [tok.eos_token_id] if tok.eos_token_id is not None else []
        )
        rows.append((p + a, [-100] * len(p) + a))
    width = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows], device=device)
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows], device=device)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def mean_logp(model: Any, batch: Mapping[str, torch.Tensor]) -> float:
    """Mean log-probability of the labelled (answer) tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][:, 1:]
    logp = torch.log_softmax(logits[:, :-1], -1)
    keep = labels != -100
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return float(picked[keep].mean())


def _init_adapter(template: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """PEFT's init drawn from ``seed``: lora_A Kaiming-uniform (bound 1/sqrt(fan_in)), lora_B zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in template.items():
        if "lora_A" in k:
            bound = 1.0 / math.sqrt(v.shape[1])
            out[k] = ((torch.rand(tuple(v.shape), generator=g) * 2 - 1) * bound).to(v.device, v.dtype)
        else:
            out[k] = torch.zeros_like(v)
    return out


def _train(model: Any, batch: Mapping[str, torch.Tensor], steps: int, lr: float) -> list[float]:
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def run(
    model_dir: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    rank: int = 16,
    alpha: int = 16,
    steps: int = 40,
    lr: float = 5e-4,
    children: int = 3,
    sweep: bool | Sequence[tuple[str, Mapping[str, Any]]] = True,
    seed: int = 0,
    tasks_per_adapter: int = 6,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[RetentionResult], dict[str, Any]]:
    """Train the three adapters, measure every operator; returns ``(rows, info)``.

    ``sweep``: True for :data:`SWEEP` after the defaults, False for the defaults only, or a list of
    ``(operator, params)`` settings to measure after the defaults."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from populora_verl.evolution.lora import delta_w_distance
    from populora_verl.evolution.operators import OPERATORS

    t_start = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(dev)
    present = {n.rsplit(".", 1)[-1] for n, _ in base.named_modules()}
    targets = [t for t in TARGETS if t in present]
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets))
    model.eval()
    template = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    thirds = [TASKS[i::3][:tasks_per_adapter] for i in range(3)]
    batches = [_encode(tok, t, dev) for t in thirds]

    def score_logp(state: Mapping[str, torch.Tensor], k: int) -> float:
        set_peft_model_state_dict(model, {n: v.to(dev) for n, v in state.items()})
        return mean_logp(model, batches[k])

    zero = {k: torch.zeros_like(v) for k, v in template.items()}
    base_logp = [score_logp(zero, k) for k in range(3)]
    parents, train_losses = [], []
    for k, init_seed in enumerate((seed * 1000 + 1, seed * 1000 + 1, seed * 1000 + 2)):  # P0, P1 related; P2 not
        set_peft_model_state_dict(model, _init_adapter(template, init_seed))
        losses = _train(model, batches[k], steps, lr)
        train_losses.append((losses[0], losses[-1]))
        parents.append({n: v.detach().clone() for n, v in get_peft_model_state_dict(model).items()})
        log(f"P{k}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    parent_logp = [score_logp(parents[k], k) for k in range(3)]

    specs: list[tuple[str, dict[str, Any]]] = [(n, {}) for n in OPERATORS]
    extra = SWEEP if sweep is True else (sweep or ())
    specs += [(n, dict(p)) for n, p in extra if n in OPERATORS]
    rows: list[RetentionResult] = []
    for name, params in specs:
        op = OPERATORS[name]
        groups = (
            [(None, [(k,) for k in range(3)])]
            if op.num_parents == 1
            else [("related", [(0, 1), (1, 0)]), ("unrelated", [(0, 2), (2, 0)])]
        )
        for pair, combos in groups:
            rets, gains, dws = [], [], []
            for combo in combos:
                k = combo[0]  # the child is scored on the (fitter) first parent's own answers
                for j in range(children):
                    gen = torch.Generator().manual_seed(seed * 7919 + j)
                    child = op([{n: v.cpu() for n, v in parents[i].items()} for i in combo], generator=gen, **params)
                    lp = score_logp(child, k)
                    rets.append(math.exp(lp - parent_logp[k]))
                    gains.append((lp - base_logp[k]) / (parent_logp[k] - base_logp[k]))
                    dist, ref = delta_w_distance(child, {n: v.cpu() for n, v in parents[k].items()})
                    dws.append(dist / ref if ref > 0 else math.inf)
            rows.append(
                RetentionResult(
                    name,
                    op.kind,
                    {**op.defaults, **params},
                    pair,
                    statistics.fmean(rets),
                    min(rets),
                    statistics.fmean(gains),
                    statistics.fmean(dws),
                )
            )
            log(
                f"{name} {params or 'default'} {pair or ''}: retention {rows[-1].retention:.3f} "
                f"gain kept {rows[-1].gain_kept:.3f}"
            )
    info = {
        "model": str(model_dir),
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "dtype": str(torch_dtype).replace("torch.", ""),
        "rank": rank,
        "alpha": alpha,
        "targets": targets,
        "steps": steps,
        "lr": lr,
        "children": children,
        "tasks_per_adapter": len(thirds[0]),
        "base_logp": base_logp,
        "parent_logp": parent_logp,
        "train_loss": train_losses,
        "seconds": time.perf_counter() - t_start,
        "torch": torch.__version__,
    }
    return rows, info


def format_table(rows: Sequence[RetentionResult], info: Mapping[str, Any]) -> str:
    lines = [
        f"Model `{info['model']}` ({info['dtype']}) on {info['gpu']}, torch {info['torch']}; LoRA r={info['rank']}, "
        f"alpha={info['alpha']} on {', '.join(info['targets'])}; 3 adapters fine-tuned {info['steps']} AdamW steps "
        f"(lr {info['lr']}) on {info['tasks_per_adapter']} tasks each (loss "
        + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in info["train_loss"])
        + "); mean answer log-prob base "
        + ", ".join(f"{x:.3f}" for x in info["base_logp"])
        + " -> parents "
        + ", ".join(f"{x:.3f}" for x in info["parent_logp"])
        + f"; {info['children']} children per parent (pair); "
        f"{info['seconds']:.0f} s in all.",
        "",
        "Score: per-token likelihood of the parent's own training answers; retention = child / parent. Gain kept = "
        "(log p child - log p base) / (log p parent - log p base).",
        "",
        "| operator | kind | params | retention | min retention | gain kept | ‖ΔW'−ΔW‖/‖ΔW‖ |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = r.kind + (f" ({r.pair})" if r.pair else "")
        params = ", ".join(f"{k}={v}" for k, v in r.params.items()) or "-"
        lines.append(
            f"| {r.operator} | {kind} | {params} | {r.retention:.3f} | {r.min_retention:.3f} | "
            f"{r.gain_kept:.3f} | {r.delta_w_rel:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Operator retention on a real model with trained adapters.")
    p.add_argument("--model", default=os.environ.get("MODEL_DIR"), help="base model folder (default: $MODEL_DIR)")
    p.add_argument("--device")
    p.add_argument("--dtype", help="torch dtype name (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--children", type=int, default=3)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the markdown table here too")
    args = p.parse_args(argv)
    if not args.model or not Path(args.model).is_dir():
        p.error(f"--model: no model folder {args.model!r} (set $MODEL_DIR or pass --model)")
    if args.out and (Path(args.out).is_dir() or not Path(args.out).absolute().parent.is_dir()):
        p.error(f"--out {args.out}: not a file in an existing folder")  # before minutes of fine-tuning
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    rows, info = run(
        args.model,
        device=args.device,
        dtype=args.dtype,
        rank=args.rank,
        alpha=args.alpha,
        steps=args.steps,
        lr=args.lr,
        children=args.children,
        sweep=not args.no_sweep,
        seed=args.seed,
        log=lambda s: print(f"[retention] {s}", file=sys.stderr, flush=True),
    )
    text = format_table(rows, info)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
