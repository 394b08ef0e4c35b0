"""Label log-probabilities from logits without verl's per-token Python loop.

verl's actor computes ``log softmax(z)[y]`` with ``verl.utils.torch_functional.logprobs_from_logits``. With the
``flash_attn`` package it uses flash-attn's fused cross-entropy; without it (no wheel exists for the tested GPU stack)
it
falls back to ``logprobs_from_logits_v2``, which loops in Python over the first dimension of the packed logits, i.e.
once per token: on an H100 that is 0.9-1.2 s forward+backward for one 8,192-token micro-batch of Qwen2.5-1.5B, and
0.043 s for this module's path (``python -m populora_verl.bench.logprob_paths``, BENCHMARKS.md §5). verl's own
alternative, ``use_fused_kernels``, reads ``lm_head.weight`` directly and fails under FSDP2 whenever the LM head is
not tied to the embeddings (verl then shards it as its own unit, and the weight is still a DTensor at that point).

:func:`label_logprobs` computes the same quantity chunk by chunk, as the flash-attn kernel does:

    forward   lp_t = z_t[y_t] - logsumexp(z_t)
    backward  dL/dz_t = g_t * (onehot(y_t) - softmax(z_t))

It saves only the logits (which the graph keeps anyway) and one float per token, so its extra memory is one chunk of
``chunk x vocab`` floats, like verl's loop, while the work per chunk is a handful of large kernels.

:func:`install` points verl's FSDP engine (and ``verl.utils.torch_functional``) at it when verl would otherwise take
the per-token fallback. ``POPULORA_LOGPROBS=verl`` keeps verl's function (for A/B runs); the worker processes read it,
so set it through Ray (``+ray_kwargs.ray_init.runtime_env.env_vars.POPULORA_LOGPROBS=verl``).
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

#: Tokens per chunk: 2,048 x 151,936 fp32 logits is 1.2 GiB of scratch, small next to an 8k-token micro-batch's logits.
DEFAULT_CHUNK = 2048
ENV = "POPULORA_LOGPROBS"
MODES = ("auto", "verl")
# Modules that bound verl's function by name at import (``from ... import logprobs_from_logits``).
_VERL_USERS = ("verl.utils.torch_functional", "verl.workers.engine.fsdp.transformer_impl")


class _LabelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        z, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        lse = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        for s in range(0, z.shape[0], chunk):
            lse[s : s + chunk] = torch.logsumexp(z[s : s + chunk].float(), dim=-1)
        picked = z.gather(-1, y.unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk = chunk
        return (picked - lse).view(labels.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        z, y, g = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), grad.reshape(-1).float()
        dz = torch.empty_like(z)
        for s in range(0, z.shape[0], ctx.chunk):
            e = s + ctx.chunk
            d = torch.exp(z[s:e].float() - lse[s:e, None]).mul_(-g[s:e, None])  # -g * softmax(z)
            d.scatter_add_(-1, y[s:e, None], g[s:e, None])  # + g * onehot(y)
            dz[s:e] = d.to(dz.dtype)
        return dz.view(logits.shape), None, None


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, labels)`` in float32, shape ``labels.shape``, in chunks of ``chunk``
    rows."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree before the vocab dim")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _LabelLogProbs.apply(logits, labels.long(), int(chunk))


def verl_logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """Drop-in for verl's ``logprobs_from_logits`` (same signature; ``inplace_backward`` only matters to flash-attn)."""
    return label_logprobs(logits, labels)


def verl_uses_flash_ce() -> bool:
    """Whether verl's ``logprobs_from_logits`` takes flash-attn's cross-entropy kernel here (verl's own test)."""
    tf = importlib.import_module("verl.utils.torch_functional")
    return (
        bool(getattr(tf, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False))
        and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1"
    )


def verl_would_loop() -> bool:
    """True when verl's ``logprobs_from_logits`` takes its per-token fallback here (no flash-attn, no NPU kernel, and
    a verl whose fallback is still the loop: one with ``logprobs_from_logits_chunked`` falls back to that)."""
    from populora_verl import verl_compat

    if verl_compat.has_chunked_logprobs():
        return False
    tf = importlib.import_module("verl.utils.torch_functional")
    return not verl_uses_flash_ce() and not getattr(tf, "NPU_CROSS_ENTROPY_LOSS_AVAILABLE", False)


def install(mode: str | None = None) -> bool:
    """Replace verl's fallback in the modules that call it; returns whether it did. ``mode`` defaults to
    ``$POPULORA_LOGPROBS`` (``auto``); ``verl`` leaves verl alone."""
    mode = (mode if mode is not None else os.environ.get(ENV, "auto")).strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {MODES}, got {mode!r}")
    if mode == "verl" or not verl_would_loop():
        return False
    from populora_verl import verl_compat

    verl_compat.private_path("populora_verl.workers.logprobs")
    for name in _VERL_USERS:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:  # an engine that cannot import here is one that cannot run here either
            logger.debug("populora: %s not importable (%s); its log-probs stay verl's", name, e)
            continue
        mod.logprobs_from_logits = verl_logprobs_from_logits
    return True
