"""Per-token log-probabilities in the actor: verl's fallback against vectorised paths.

verl 0.9.1 computes the actor's log-probs with ``verl.utils.torch_functional.logprobs_from_logits``. Without the
``flash_attn`` package (no wheel for the tested GPU stack, which has only vLLM's own FlashAttention) it falls back
to ``logprobs_from_logits_v2``, which loops in Python over the first dimension of the logits. verl's engine hands it
packed logits of shape ``(tokens, vocab)``, so the loop runs once per token, forward and backward: a cost per token
that does not depend on the model's size. This bench times that path against two that do not loop per token, on the
same shapes, forward and backward:

* ``verl_fallback``: ``logprobs_from_logits_v2(logits, labels)`` (what the actor runs today);
* ``vectorised``: ``log_softmax`` + ``gather`` over the whole ``(tokens, vocab)`` block in fp32;
* ``verl_fused_torch``: verl's own ``FusedLinearForPPO`` (``actor_rollout_ref.model.use_fused_kernels=true``,
  ``fused_kernel_options.impl_backend=torch``): log-probs and entropy from the hidden states and the LM head in
  chunks of 512 tokens, without materialising the logits;
* ``populora_chunked``: :func:`populora_verl.workers.logprobs.label_logprobs` on the logits in the model's dtype
  (what our worker installs in place of the fallback): logsumexp and the gradient in chunks of 2,048 tokens.

    python -m populora_verl.bench.logprob_paths [--tokens 8192] [--vocab 151936] [--hidden 896] [--rounds 5]

Rounds interleave the paths; the report gives the median and the spread (min-max) per path and the ratio to the
fallback, with the device. On a GPU each timing ends with a synchronisation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from populora_verl.workers.logprobs import label_logprobs, verl_uses_flash_ce

__all__ = ["PATHS", "run", "main"]


def _verl_fallback(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from verl.utils.torch_functional import logprobs_from_logits_v2

    logits = (hidden @ weight.t()).float()
    return logprobs_from_logits_v2(logits, labels)


def _vectorised(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _verl_fused_torch(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    log_probs, _entropy = FusedLinearForPPO(impl_backend="torch")(hidden, weight, labels)
    return log_probs


def _populora_chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return label_logprobs(hidden @ weight.t(), labels)


PATHS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "verl_fallback": _verl_fallback,
    "vectorised": _vectorised,
    "verl_fused_torch": _verl_fused_torch,
    "populora_chunked": _populora_chunked,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    tokens: int,
    vocab: int,
    hidden: int,
    rounds: int,
    *,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    paths: list[str] | None = None,
    seed: int = 0,
    peaks: dict[str, float] | None = None,
) -> dict[str, list[float]]:
    """Seconds per forward+backward for each path, ``rounds`` interleaved rounds after one warm-up round. On a GPU,
    ``peaks`` (if given) receives each path's peak memory above its inputs, in GiB."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h0 = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dev, dt)
    w0 = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(dev, dt)
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(dev)
    names = paths or list(PATHS)
    times: dict[str, list[float]] = {n: [] for n in names}
    reference = None
    for r in range(rounds + 1):
        for name in names:
            h = h0.detach().clone().requires_grad_(True)
            _sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            t0 = time.perf_counter()
            out = PATHS[name](h, w0, labels)
            out.sum().backward()
            _sync(dev)
            dt_s = time.perf_counter() - t0
            if dev.type == "cuda" and peaks is not None:
                peaks[name] = max(peaks.get(name, 0.0), (torch.cuda.max_memory_allocated(dev) - base) / 2**30)
            if r == 0:  # warm-up round: also check that the paths agree
                if reference is None:
                    reference = out.detach().float()
                else:
                    torch.testing.assert_close(out.detach().float(), reference, rtol=2e-2, atol=2e-2)
            else:
                times[name].append(dt_s)
    return times


def report(times: dict[str, list[float]], tokens: int, device: str, peaks: dict[str, float] | None = None) -> str:
    base = statistics.median(times["verl_fallback"]) if "verl_fallback" in times else None
    lines = [
        f"device {device}; {tokens} tokens; forward + backward; median (min-max) over {len(next(iter(times.values())))}"
        " interleaved rounds",
        "",
        "| path | ms | min-max ms | µs per token | × verl_fallback | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{med / base:.3f}" if base else "-"
        peak = f"{peaks[name]:.2f}" if peaks and name in peaks else "-"
        lines.append(
            f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | "
            f"{med / tokens * 1e6:.1f} | {ratio} | {peak} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per call (one micro-batch of the actor)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen2.5: 151936)")
    ap.add_argument("--hidden", type=int, default=896, help="hidden size (Qwen2.5-0.5B: 896, 1.5B: 1536)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {list(PATHS)}")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in names if p not in PATHS]
    if unknown:
        ap.error(f"unknown path(s) {unknown}; choose from {list(PATHS)}")
    if args.tokens < 1 or args.vocab < 2 or args.hidden < 1 or args.rounds < 1:
        ap.error("--tokens, --hidden and --rounds must be >= 1 and --vocab >= 2")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peaks: dict[str, float] = {}
    times = run(args.tokens, args.vocab, args.hidden, args.rounds, paths=names, peaks=peaks)
    print(report(times, args.tokens, device, peaks))
    print(
        f"\nverl's actor uses the flash-attn cross-entropy kernel here: {verl_uses_flash_ce()} "
        "(False: verl alone would run verl_fallback; PopuLoRA's worker runs populora_chunked instead)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
