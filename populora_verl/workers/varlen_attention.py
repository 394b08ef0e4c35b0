"""``attn_implementation=populora_varlen``: packed (remove-padding) training attention without the flash-attn package.

verl's remove-padding path (``model.use_remove_padding=true``) runs the model on one packed row (``input_ids`` of
shape ``(1, total_tokens)``, ``attention_mask=None``, ``position_ids`` restarting at every sequence). flash-attn has
no binary wheel on PyPI, and ``sdpa`` handles the packed row through transformers' block-diagonal mask, which
attends over the whole row (quadratic in its length). Torch itself ships a varlen flash kernel with backward
(``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10): this attention function finds the sequence boundaries
from ``position_ids`` and calls it, so each token attends only within its own sequence, at flash cost.

Opt in with ``actor_rollout_ref.model.use_remove_padding=true
++actor_rollout_ref.model.override_config.attn_implementation=populora_varlen``. The function registers itself with
transformers' ``AttentionInterface`` when the PopuLoRA worker module is imported (the worker processes build the
model). A batch that is not one packed row (or has no ``position_ids``) falls back to ``sdpa``; on CPU the same
boundaries are used with one ``sdpa`` call per sequence (the reference the tests compare against).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["NAME", "cu_seqlens", "varlen_attention_forward", "register"]

NAME = "populora_varlen"


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence starts (int32, ``N+1``) and the longest sequence of one packed row: a sequence starts
    wherever the position does not continue the previous one (transformers' packed-sequence rule)."""
    pos = position_ids.reshape(-1)
    n = pos.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.int32, device=pos.device), 0
    starts = torch.ones(n, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = torch.nonzero(starts).flatten()
    cu = torch.cat([idx, torch.tensor([n], device=pos.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    """torch's varlen flash attention, causal, across the signatures torch releases have given it."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn offers no causal mode in this torch")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """The same attention with one causal ``sdpa`` call per sequence (CPU, tests)."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=0), vs.repeat_interleave(rep, dim=0)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(
            0, 1
        )
    return out


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``(B, H, S, D)`` in, ``(B, S, H, D)`` out (as ``sdpa_attention_forward``)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[0] != 1 or attention_mask is not None or kwargs.get("sliding_window"):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (S, H, D)
    cu, max_len = cu_seqlens(position_ids)
    cu = cu.to(q.device)
    if q.is_cuda:
        out = _flash_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scaling)
    else:
        out = _reference_varlen(q, k, v, cu, scaling)
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``attn_implementation=populora_varlen`` known to transformers (idempotent). The mask is FA2's: ``None``
    for a packed row, the boundaries coming from ``position_ids``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
