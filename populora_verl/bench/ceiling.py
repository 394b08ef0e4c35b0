"""The generation ceiling: plain vLLM offline ``generate`` doing one PopuLoRA step's rollout work, for comparison.

    python -m populora_verl.bench.ceiling --model /tmp/models/qwen-coder-1.5b --spec spec.json --out ceiling.json
    python -m populora_verl.bench.ceiling --model DIR --adapters 8 --requests 24,48 --prompt-tokens 300 \\
        --answer-tokens 1024 --out ceiling.json

The same model, the same number of LoRA adapters (random, non-zero, written as PEFT folders with the trainer's rank,
alpha and target modules), the same requests per rollout phase and the same prompt and answer lengths as a measured
configuration (answers forced to length with ``min_tokens``/``ignore_eos``), the same engine settings as our rollout
(CUDA graphs, sampled log-probs, prefix caching), one engine for every configuration. Each configuration's two phases
run back to back, as in our step; after a warm-up pass with short answers, ``--repeats`` rounds interleave the
configurations and the median time is reported. Writes ``{"configs": {name: {"tok_s", "time_s", "tokens", ...}},
"startup_s", ...}``.

``--spec`` is what :func:`populora_verl.bench.step_scaling.ceiling_spec` writes:
``{name: {"adapters": N, "phases": [{"requests", "prompt_tokens", "answer_tokens", "loras"}, ...]}}``; phase k's
requests go round-robin to ``loras`` adapters, the teachers' and the students' being distinct as in the population.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["lora_shapes", "write_random_adapters", "plan_requests", "adapters_needed", "load_spec", "main"]

#: Modules verl's ``target_modules: all-linear`` reaches in a Qwen2 decoder layer (PEFT leaves lm_head out).
QWEN2_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shapes(config: Mapping[str, Any], targets: Sequence[str] = QWEN2_LINEAR) -> dict[str, tuple[int, int]]:
    """``module name -> (in_features, out_features)`` of every LoRA target of a Qwen2-style decoder (HF config)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    unknown = [t for t in targets if t not in dims]
    if unknown:
        raise ValueError(f"no shape rule for target modules {unknown} (known: {sorted(dims)})")
    out = {}
    for layer in range(int(config["num_hidden_layers"])):
        for t in targets:
            group = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out[f"model.layers.{layer}.{group}.{t}"] = dims[t]
    return out


def write_random_adapters(
    model_dir: str | Path,
    out_dir: str | Path,
    n: int,
    rank: int,
    alpha: int,
    targets: Sequence[str] = QWEN2_LINEAR,
    seed: int = 0,
) -> list[Path]:
    """``n`` PEFT adapter folders with random non-zero A and B (so vLLM really runs the LoRA kernels)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = lora_shapes(config, targets)
    gen = torch.Generator().manual_seed(seed)
    dirs = []
    for k in range(n):
        tensors = {}
        for name, (fan_in, fan_out) in shapes.items():
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * 0.01
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
        d = Path(out_dir) / f"adapter_{k}"
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=list(targets),
            task_type="CAUSAL_LM",
            base_model_name_or_path=str(model_dir),
        ).save_pretrained(str(d))
        dirs.append(d)
    return dirs


def load_spec(path: str | Path) -> dict[str, dict[str, Any]]:
    spec = json.loads(Path(path).read_text())
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"{path}: expected a non-empty mapping of configuration -> phases")
    for name, c in spec.items():
        phases = c.get("phases") if isinstance(c, dict) else None
        if not phases:
            raise ValueError(f"{path}: configuration {name!r} has no phases")
        for p in phases:
            for key in ("requests", "prompt_tokens", "answer_tokens", "loras"):
                if int(p.get(key, 0)) < 1:
                    raise ValueError(f"{path}: {name} phase {p.get('phase')!r} needs {key} >= 1")
    return spec


def plan_requests(
    phases: Sequence[Mapping[str, Any]], vocab: int, seed: int = 0
) -> list[list[tuple[list[int], int, int]]]:
    """Per phase, ``(prompt token ids, adapter index, answer tokens)`` per request. Adapters are numbered across
    phases (phase 0 uses 0..loras0-1, phase 1 the next ones) unless a phase names its ``first_lora`` (the single
    agent serves both phases with adapter 0); requests go round-robin over their phase's adapters, and prompts are
    random ids (no shared prefix: the ceiling does not lean on prefix caching)."""
    rng = random.Random(seed)
    out, nxt = [], 0
    for p in phases:
        n, loras = int(p["requests"]), int(p["loras"])
        first = int(p.get("first_lora", nxt))
        plen, alen = int(p["prompt_tokens"]), int(p["answer_tokens"])
        out.append(
            [
                ([rng.randrange(100, max(101, vocab - 1)) for _ in range(plen)], first + i % loras, alen)
                for i in range(n)
            ]
        )
        nxt = max(nxt, first + loras)
    return out


def adapters_needed(spec: Mapping[str, Mapping[str, Any]]) -> int:
    """The most adapters any configuration's phases address (``first_lora`` + ``loras``, numbered as in
    :func:`plan_requests`)."""
    most = 0
    for c in spec.values():
        nxt = 0
        for p in c["phases"]:
            nxt = max(nxt, int(p.get("first_lora", nxt)) + int(p["loras"]))
        most = max(most, nxt)
    return most


def _spec_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    reqs = [int(x) for x in args.requests.split(",") if x.strip()]
    loras = [int(x) for x in (args.phase_loras or "").split(",") if x.strip()] or [
        max(1, args.adapters // len(reqs))
    ] * len(reqs)
    phases = [
        {
            "phase": f"phase{i}",
            "requests": r,
            "prompt_tokens": args.prompt_tokens,
            "answer_tokens": args.answer_tokens,
            "loras": lora,
        }
        for i, (r, lora) in enumerate(zip(reqs, loras, strict=True))
    ]
    return {f"{args.adapters}_adapters": {"adapters": args.adapters, "phases": phases}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", help="JSON written by step_scaling (configurations and their phases)")
    ap.add_argument("--adapters", type=int, default=8, help="without --spec: LoRA adapters")
    ap.add_argument("--requests", default="24,48", help="without --spec: requests per phase")
    ap.add_argument("--phase-loras", default="", help="without --spec: adapters per phase (default: split evenly)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=1024)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (our old rollout setting)")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds (interleaved over configurations)")
    ap.add_argument("--out", default="ceiling.json")
    ap.add_argument("--workdir", default="/tmp/populora-ceiling", help="where the random adapters are written")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec) if args.spec else _spec_from_args(args)
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError:
        print("ceiling: needs a CUDA GPU and vLLM; nothing was run.", file=sys.stderr)
        return 2

    from populora_verl.bench.step_scaling import CUDAGRAPH_SIZES

    n_adapters = adapters_needed(spec)
    max_len = max(int(p["prompt_tokens"]) + int(p["answer_tokens"]) for c in spec.values() for p in c["phases"])
    dirs = write_random_adapters(args.model, args.workdir, n_adapters, args.lora_rank, args.lora_alpha)
    t0 = time.time()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enable_lora=True,
        max_loras=n_adapters,
        max_cpu_loras=n_adapters,
        max_lora_rank=args.lora_rank,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_len + 16,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        seed=0,
        compilation_config=None if args.enforce_eager else {"cudagraph_capture_sizes": CUDAGRAPH_SIZES},
    )
    startup = time.time() - t0
    loras = [LoRARequest(f"ceiling{k}", k + 1, str(d)) for k, d in enumerate(dirs)]
    vocab = int(llm.get_tokenizer().vocab_size)
    plans = {name: plan_requests(c["phases"], vocab, seed=7) for name, c in spec.items()}

    def run(plan: list[list[tuple[list[int], int, int]]]) -> tuple[float, int]:
        start, tokens = time.perf_counter(), 0
        for phase in plan:  # our step runs teachers, then students on the teachers' output
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in phase]
            params = [
                SamplingParams(temperature=1.0, top_p=1.0, max_tokens=a, min_tokens=a, ignore_eos=True, logprobs=0)
                for _, _, a in phase
            ]
            outs = llm.generate(prompts, params, lora_request=[loras[k] for _, k, _ in phase], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return time.perf_counter() - start, tokens

    # Warm-up, not timed: every configuration's batches and adapters with short answers (LoRA kernel JIT,
    # first graph replays), so the timed rounds pay only generation.
    t1 = time.time()
    for plan in plans.values():
        run([[(ids, k, min(a, 16)) for ids, k, a in phase] for phase in plan])
    warmup = time.time() - t1
    times: dict[str, list[float]] = {n: [] for n in spec}
    tokens: dict[str, int] = {}
    for rnd in range(args.repeats):
        for i, name in enumerate(spec):  # interleaved rounds; fresh prompts each time (no prefix-cache hits)
            dt, tok = run(plan_requests(spec[name]["phases"], vocab, seed=1000 * (rnd + 1) + i))
            times[name].append(dt)
            tokens[name] = tok
    result = {
        "model": args.model,
        "gpu": torch.cuda.get_device_name(0),
        "startup_s": startup,
        "warmup_s": warmup,
        "adapters": n_adapters,
        "enforce_eager": args.enforce_eager,
        "configs": {},
    }
    for name in spec:
        med = statistics.median(times[name])
        result["configs"][name] = {
            "tokens": tokens[name],
            "time_s": times[name],
            "median_s": med,
            "tok_s": tokens[name] / med if med > 0 else None,
            "phases": spec[name]["phases"],
        }
        print(
            f"ceiling {name}: {tokens[name]} tokens in {med:.2f} s (median of {args.repeats}) = "
            f"{tokens[name] / med:.0f} tok/s; runs {[round(t, 2) for t in times[name]]}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"ceiling: engine start-up {startup:.0f} s, warm-up {warmup:.0f} s -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
