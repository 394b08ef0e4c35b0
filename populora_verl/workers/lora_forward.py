"""A leaner forward for PEFT's LoRA ``Linear`` in the trainer: one linear and one ``addmm`` for the adapter.

PEFT computes a LoRA layer as ``result + lora_B(lora_A(dropout(x))) * scaling``: three submodule calls, a scaling
multiply and an add, each a kernel or a Python call, for each of the ~200 LoRA layers of a 1.5B model, forward and
backward, per micro-batch. verl's torch profile of a 4T4S update (BENCHMARKS.md §5) shows a trainer waiting on such
launches: the GPU busy about a third of the time, the scaling multiplies and bf16 adds among the most frequent
kernels. For plain LoRA the same quantity is

    y = base(x) + s * (x A^T) B^T   =   addmm(base(x), x A^T, B^T, alpha=s)

so the multiply and the add ride in the second matmul's epilogue and the three submodule calls disappear. The
gradients are those of the same expression (addmm's backward is two matmuls scaled by ``alpha``).

Only the case that formula covers takes the short path: adapters enabled and not merged, one active adapter without
a variant (DoRA etc.), no dropout, no LoRA bias, no extra forward arguments, and input, result and weights of one
dtype (or autocast on, which casts all of them alike). Anything else goes to PEFT's own forward, unchanged.

:func:`install` puts it on PEFT's class in the process that trains (the worker module calls it at import) when
``POPULORA_LORA_FORWARD=lean``; PEFT's forward stays the default. Measured on 2 x H200 with Qwen2.5-Coder-1.5B
(BENCHMARKS.md §5), the update with this forward and FSDP's parameters kept after the forward was within the run's
+-10 % noise of PEFT's (4T4S update 8.71 against 8.72 s), so it stays opt-in until a quieter measurement shows a gain.
The worker processes read the variable, so set it through Ray
(``+ray_kwargs.ray_init.runtime_env.env_vars.POPULORA_LORA_FORWARD=lean``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ENV", "MODES", "install", "uninstall", "installed", "lean_lora_forward"]

ENV = "POPULORA_LORA_FORWARD"
MODES = ("lean", "peft")
_PEFT_FORWARD = "_populora_peft_forward"  # PEFT's own forward, kept on the class while ours is installed


def _short_path(layer: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(A, B, scaling)`` when ``layer`` computes plain LoRA for this call, else ``None``."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    variants = getattr(layer, "lora_variant", {})  # DoRA and friends (older PEFT: use_dora)
    if name not in layer.lora_A or name in variants or getattr(layer, "use_dora", {}).get(name, False):
        return None
    if not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    return lora_a.weight, lora_b.weight, layer.scaling[name]


def lean_lora_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT ``lora.Linear.forward`` with the plain-LoRA case as ``addmm(base(x), x A^T, B^T, alpha=s)``."""
    short = _short_path(self, args, kwargs)
    if short is None:
        return getattr(type(self), _PEFT_FORWARD)(self, x, *args, **kwargs)
    a, b, scaling = short
    result = self.base_layer(x)
    if x.dtype != a.dtype and getattr(self, "cast_input_dtype_enabled", True):
        x = x.to(a.dtype)  # as PEFT's _cast_input_dtype
    if not torch.is_autocast_enabled(x.device.type) and not (result.dtype == x.dtype == a.dtype == b.dtype):
        # mixed dtypes without autocast: PEFT's arithmetic (promotion, then back to the base layer's dtype)
        return (result + F.linear(F.linear(x, a), b) * scaling).to(result.dtype)
    # 2-D throughout: a 3-D linear would view, multiply and view back for each of the two matmuls
    xa = F.linear(x.reshape(-1, x.shape[-1]), a)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), xa, b.t(), alpha=scaling)
    return out.view(result.shape)


def _peft_linear() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


def installed() -> bool:
    return _PEFT_FORWARD in vars(_peft_linear())


def install(mode: str | None = None) -> bool:
    """Put :func:`lean_lora_forward` on PEFT's ``lora.Linear``; returns whether it is installed. ``mode`` defaults
    to ``$POPULORA_LORA_FORWARD`` (``peft``); ``peft`` leaves PEFT alone (and undoes an earlier install)."""
    mode = (mode if mode is not None else os.environ.get(ENV, "peft")).strip().lower() or "peft"
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {MODES}, got {mode!r}")
    if mode == "peft":
        uninstall()
        return False
    cls = _peft_linear()
    if not installed():
        setattr(cls, _PEFT_FORWARD, cls.forward)
        cls.forward = lean_lora_forward
    return True


def uninstall() -> None:
    cls = _peft_linear()
    if installed():
        cls.forward = vars(cls)[_PEFT_FORWARD]
        delattr(cls, _PEFT_FORWARD)
