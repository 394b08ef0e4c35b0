"""LoRA weight-space evolution operators: mutations and crossovers that make same-rank children.

Interface (docs/CONTRACTS.md)::

    child = OPERATORS["svd_mutation"]([parent], generator=g, eps=0.1)
    child = OPERATORS["svd_crossover"]([fitter, other], generator=g)

Parents and children are PEFT LoRA state dicts (``*.lora_A.weight [r, in]``, ``*.lora_B.weight [out, r]``).
A child keeps its first parent's keys, order, shapes, dtypes and devices; parents are never modified; the same
generator state gives the same child (on the same device). Noise is drawn in fp32 on the generator's device and
the child is cast back to the parent's dtype (bf16 adapters work). Crossover parents are ordered fittest first.

Candidate set (formulas and defaults: the lucidrains/populora reference implementation; two
defaults are ours, recalibrated on trained adapters so a mutation keeps its parent's skill: M3 ρ = 0.05 instead of
0.3 and M5 α = 1 instead of 10, see ``populora_verl.bench.retention_real`` and BENCHMARKS.md):

====  =========================  ========  ============================================================
id    name                       kind      what it does
====  =========================  ========  ============================================================
M1    svd_mutation               mutation  S' = S·exp(ε z); U, V rotated by orth(I + ε·skew(M)); rebuild
M2    layer_gaussian             mutation  ε·std(X)·N(0,1) on A and B of max(1, ⌊f·L⌋) random modules
M3    component_mask             mutation  zero ⌈ρ·r⌉ random singular values per module; rebuild (ρ = 0.05)
M4    full_gaussian              mutation  M2 on every module
M5    neftune                    mutation  A += U(-b, b), b = α / sqrt(in·r) (α = 1)
X1    dare_crossover             crossover mean over parents of DARE(X) = X·Bernoulli(1-p)/(1-p), A and B apart
X2    layer_crossover            crossover each module's (A, B) copied whole from one random parent
X3    svd_crossover              crossover top-k components of parents[0] + components k+1..r of parents[1]
X4    extrapolative_crossover    crossover θ = θ₁ + η(θ₀ − θ₁), η ~ U(1, 1.5): past the fitter parents[0]
====  =========================  ========  ============================================================

Design decisions (documented in docs/operators.md as well):

* **Raw factors, no α/r.** Operators act on the stored ``lora_A``/``lora_B``; PEFT multiplies by α/r at forward
  time. Rank and α are identical across the population, so α/r is one common constant factor on every ΔW: it
  commutes with every operator here (SVD ops scale S, Gaussian noise is relative to std(X), crossovers are
  linear or selective), except M5 whose absolute bound is defined on raw A (as in NEFTune / lucidrains).
* **Factor space vs ΔW space.** X1, X4 combine A's and B's separately (factor space): the child's ``B A`` is not
  the same combination of the parents' ΔW's, and the result is meaningful only when parents share a gauge
  (common ancestry / the same A initialisation, as PBT children do). X2 copies whole (A, B) pairs, so it is exact
  in both spaces. X3 works in ΔW space through SVDs: it is gauge-invariant. All keep rank ≤ r by construction.
* **Gauge.** SVD operators (M1, M3, X3) rebuild factors in the gauge of :func:`lora.factors_from_svd` even when
  ΔW is unchanged, so children of SVD operators (and crossovers) should start with fresh optimizer moments.
* **Zero B** (PEFT's initialisation). M2/M4 use the fallback std ``1/sqrt(last dim)`` for a tensor with std ≈ 0,
  so a zero B still gets noise. SVD operators on a zero ΔW return a finite, trainable child with B = 0.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from populora_verl.config import OPERATOR_KINDS as KINDS

from .lora import (
    LoRAStack,
    a_row_rms,
    check_compatible,
    factors_from_svd,
    lora_svd,
    orthonormalize,
    stack_adapter,
    unstack_adapter,
)

__all__ = ["Operator", "OPERATORS", "register_operator", "get_operator", "MUTATIONS", "CROSSOVERS"]

Adapter = dict[str, Tensor]
# std below this counts as "zero" (PEFT's B = 0): use the 1/sqrt(last dim) fallback scale instead.
_ZERO_STD = 1e-10


@dataclass(frozen=True)
class Operator:
    """A registered operator. Call it on PEFT state dicts; ``fn`` is the underlying function on LoRA stacks."""

    name: str
    kind: str
    num_parents: int
    fn: Callable[..., LoRAStack] = field(repr=False)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.fn) or ""

    def __call__(
        self, parents: Sequence[Mapping[str, Tensor]], *, generator: torch.Generator, **params: Any
    ) -> Adapter:
        if isinstance(parents, Mapping):
            raise TypeError(f"{self.name}: parents must be a sequence of state dicts, got a single mapping")
        parents = list(parents)
        if len(parents) != self.num_parents:
            raise ValueError(
                f"{self.name} is a {self.kind} and needs exactly {self.num_parents} parent(s), got {len(parents)}"
            )
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise TypeError(f"{self.name}: unknown parameter(s) {unknown}; accepted: {sorted(self.defaults)}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"{self.name}: generator must be a torch.Generator, got {type(generator).__name__}")
        check_compatible(parents)
        stacks = [stack_adapter(p) for p in parents]
        child = self.fn(stacks, generator=generator, **{**self.defaults, **params})
        return unstack_adapter(child, parents[0])


OPERATORS: dict[str, Operator] = {}


def register_operator(
    name: str, *, kind: str, num_parents: int
) -> Callable[[Callable[..., LoRAStack]], Callable[..., LoRAStack]]:
    """Decorator registering ``fn(parents: list[LoRAStack], *, generator, **params) -> LoRAStack`` as ``name``.

    The operator's parameters and defaults are ``fn``'s keyword-only arguments (besides ``generator``); every one
    needs a default. Re-registering a name with a different function is an error (verl's registry idiom). The
    function itself is returned unchanged, so it stays callable on stacks.
    """
    if kind not in KINDS:
        raise ValueError(f"operator {name!r}: kind must be one of {KINDS}, got {kind!r}")
    if num_parents not in (1, 2) or (kind == "mutation") != (num_parents == 1):
        raise ValueError(
            f"operator {name!r}: a mutation takes 1 parent and a crossover 2, got {kind} with {num_parents}"
        )

    def decorator(fn: Callable[..., LoRAStack]) -> Callable[..., LoRAStack]:
        defaults = {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "generator":
                if p.default is inspect.Parameter.empty:
                    raise ValueError(f"operator {name!r}: parameter {p.name!r} needs a default")
                defaults[p.name] = p.default
        if name in OPERATORS and OPERATORS[name].fn is not fn:
            raise ValueError(f"operator {name!r} has already been registered: {OPERATORS[name].fn} vs {fn}")
        OPERATORS[name] = Operator(name, kind, num_parents, fn, MappingProxyType(defaults))
        return fn

    return decorator


def get_operator(name: str) -> Operator:
    """``OPERATORS[name]`` with an error that lists the known names."""
    try:
        return OPERATORS[name]
    except KeyError:
        raise ValueError(f"unknown operator {name!r}; known: {sorted(OPERATORS)}") from None


# --- small helpers ------------------------------------------------------------------------------------------------


def _check(cond: bool, op: str, param: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: parameter {param!r} {msg}")


def _randn(shape: tuple[int, ...], generator: torch.Generator, like: Tensor) -> Tensor:
    """fp32 N(0, 1) drawn on the generator's device (determinism), moved to ``like``'s device."""
    return torch.randn(shape, generator=generator, device=generator.device).to(like.device)


def _rand(shape: tuple[int, ...], generator: torch.Generator, like: Tensor) -> Tensor:
    """fp32 U[0, 1) drawn on the generator's device, moved to ``like``'s device."""
    return torch.rand(shape, generator=generator, device=generator.device).to(like.device)


def _noise_scale(x: Tensor) -> Tensor:
    """Per-module std of ``x [n, a, b]`` -> ``[n, 1, 1]``; ``1/sqrt(b)`` where the std is ≈ 0 (PEFT's zero B)."""
    std = x.std(dim=(-2, -1), correction=0, keepdim=True)
    return torch.where(std > _ZERO_STD, std, torch.full_like(std, x.shape[-1] ** -0.5))


def _relative_gaussian(x: Tensor, eps: float, generator: torch.Generator) -> Tensor:
    """x + ε·std(x)·N(0, 1), per module."""
    return x + eps * _noise_scale(x) * _randn(tuple(x.shape), generator, x)


def _small_rotation(eps: float, n: int, r: int, generator: torch.Generator, like: Tensor) -> Tensor:
    """``n`` near-identity orthogonal r x r matrices: orth(I + ε·skew(M)), M ~ N(0, 1)."""
    m = _randn((n, r, r), generator, like)
    eye = torch.eye(r, device=like.device)
    # U has orthonormal columns, so orthonormalising U·R equals U·orth(R): an r x r QR instead of an out x r one.
    return orthonormalize(eye + eps * (m - m.transpose(-1, -2)) / 2)


def _module_mask(stack: LoRAStack, chosen: Tensor) -> list[Tensor]:
    """Split a boolean mask over all modules (in stack order) into one mask per group."""
    sizes = [len(g.names) for g in stack]
    return list(torch.split(chosen, sizes))


def _num_modules(stack: LoRAStack) -> int:
    return sum(len(g.names) for g in stack)


# --- mutations -------------------------------------------------------------------------------------------------


@register_operator("svd_mutation", kind="mutation", num_parents=1)
def svd_mutation(parents: Sequence[LoRAStack], *, generator: torch.Generator, eps: float = 0.1) -> LoRAStack:
    """M1 SVD-structured mutation: S' = S·exp(ε z), U' = U·orth(I + ε·skew(M_U)), V' = V·orth(I + ε·skew(M_V)).

    z ~ N(0, I_r), M ~ N(0, 1)^{r×r}, independent per module and per singular-vector set; skew(M) = (M − Mᵀ)/2.
    ε = 0 returns the parent's ΔW (in the rebuilt gauge). A zero ΔW stays zero (S = 0) with a trainable A.
    """
    _check(eps >= 0, "svd_mutation", "eps", f"must be >= 0, got {eps!r}")
    child = []
    for g in parents[0]:
        u, s, v = lora_svd(g.A, g.B)
        n, r = s.shape
        s = s * torch.exp(eps * _randn((n, r), generator, s))
        u = u @ _small_rotation(eps, n, r, generator, u)
        v = v @ _small_rotation(eps, n, r, generator, v)
        child.append(g.like(*factors_from_svd(u, s, v, a_row_rms(g.A))))
    return child


@register_operator("layer_gaussian", kind="mutation", num_parents=1)
def layer_gaussian(
    parents: Sequence[LoRAStack], *, generator: torch.Generator, eps: float = 0.1, fraction: float = 0.33
) -> LoRAStack:
    """M2 layer-selective Gaussian: on max(1, ⌊f·L⌋) random modules of L, X += ε·std(X)·N(0, 1) for X in {A, B}.

    std(X) is per module and per factor; where it is ≈ 0 (a fresh PEFT B) the scale is 1/sqrt(last dim).
    """
    _check(eps >= 0, "layer_gaussian", "eps", f"must be >= 0, got {eps!r}")
    _check(0 < fraction <= 1, "layer_gaussian", "fraction", f"must be in (0, 1], got {fraction!r}")
    stack = parents[0]
    total = _num_modules(stack)
    k = max(1, math.floor(fraction * total))
    chosen = torch.zeros(total, dtype=torch.bool)
    chosen[torch.randperm(total, generator=generator, device=generator.device)[:k].cpu()] = True
    child = []
    for g, mask in zip(stack, _module_mask(stack, chosen)):
        idx = mask.nonzero().squeeze(-1).to(g.A.device)
        a, b = g.A.clone(), g.B.clone()
        if len(idx):  # draw noise for the chosen modules only
            a[idx] = _relative_gaussian(g.A[idx], eps, generator)
            b[idx] = _relative_gaussian(g.B[idx], eps, generator)
        child.append(g.like(a, b))
    return child


@register_operator("component_mask", kind="mutation", num_parents=1)
def component_mask(parents: Sequence[LoRAStack], *, generator: torch.Generator, rho: float = 0.05) -> LoRAStack:
    """M3 component masking: per module, zero ⌈ρ·r⌉ random singular values and rebuild.

    The tensors keep rank r; the effective rank drops. A masked component keeps its A row (B column = 0), so
    training can revive it. ρ = 0 returns the parent's ΔW.
    """
    _check(0 <= rho <= 1, "component_mask", "rho", f"must be in [0, 1], got {rho!r}")
    child = []
    for g in parents[0]:
        u, s, v = lora_svd(g.A, g.B)
        n, r = s.shape
        drop = math.ceil(rho * r)
        # The `drop` components with the smallest random keys are masked: a uniform random subset per module.
        rank_of = _rand((n, r), generator, s).argsort(-1).argsort(-1)
        s = torch.where(rank_of < drop, torch.zeros_like(s), s)
        child.append(g.like(*factors_from_svd(u, s, v, a_row_rms(g.A))))
    return child


@register_operator("full_gaussian", kind="mutation", num_parents=1)
def full_gaussian(parents: Sequence[LoRAStack], *, generator: torch.Generator, eps: float = 0.15) -> LoRAStack:
    """M4 full Gaussian: X += ε·std(X)·N(0, 1) for A and B of every module (M2's noise, std fallback included)."""
    _check(eps >= 0, "full_gaussian", "eps", f"must be >= 0, got {eps!r}")
    return [
        g.like(_relative_gaussian(g.A, eps, generator), _relative_gaussian(g.B, eps, generator)) for g in parents[0]
    ]


@register_operator("neftune", kind="mutation", num_parents=1)
def neftune(parents: Sequence[LoRAStack], *, generator: torch.Generator, alpha: float = 1.0) -> LoRAStack:
    """M5 NEFTune-style: A += U(−b, b) with b = α / sqrt(in·r); B unchanged (so a zero ΔW stays zero).

    PEFT's A init is U(−1/sqrt(in), 1/sqrt(in)), so the noise is α/sqrt(r) times A's own scale: lucidrains'
    α = 10 replaces A by noise (‖ΔW'−ΔW‖/‖ΔW‖ ≈ 3 at r = 4); α = 1 is a mutation of the size of the others.
    """
    _check(alpha >= 0, "neftune", "alpha", f"must be >= 0, got {alpha!r}")
    child = []
    for g in parents[0]:
        _, r, d_in = g.A.shape
        bound = alpha / math.sqrt(d_in * r)
        noise = (2 * _rand(tuple(g.A.shape), generator, g.A) - 1) * bound
        child.append(g.like(g.A + noise, g.B.clone()))
    return child


# --- crossovers --------------------------------------------------------------------------------------------------


@register_operator("dare_crossover", kind="crossover", num_parents=2)
def dare_crossover(parents: Sequence[LoRAStack], *, generator: torch.Generator, p: float = 0.7) -> LoRAStack:
    """X1 DARE crossover (factor space): X' = mean_i( X_i ⊙ m_i / (1 − p) ), m_i ~ Bernoulli(1 − p), A and B apart.

    p = 0 is the plain factor average (identical parents -> the parent).
    """
    _check(0 <= p < 1, "dare_crossover", "p", f"must be in [0, 1), got {p!r}")

    def dare(x: Tensor) -> Tensor:
        keep = _rand(tuple(x.shape), generator, x) >= p
        return x * keep / (1 - p)

    return [g0.like((dare(g0.A) + dare(g1.A)) / 2, (dare(g0.B) + dare(g1.B)) / 2) for g0, g1 in zip(*parents)]


@register_operator("layer_crossover", kind="crossover", num_parents=2)
def layer_crossover(parents: Sequence[LoRAStack], *, generator: torch.Generator, p_first: float = 0.5) -> LoRAStack:
    """X2 layer-wise crossover: each module's (A, B) pair is copied whole from parents[0] with prob. p_first, else
    from parents[1]. Exact in both factor and ΔW space (pairs are never split)."""
    _check(0 <= p_first <= 1, "layer_crossover", "p_first", f"must be in [0, 1], got {p_first!r}")
    s0, s1 = parents
    from_first = torch.rand(_num_modules(s0), generator=generator, device=generator.device).cpu() < p_first
    child = []
    for g0, g1, mask in zip(s0, s1, _module_mask(s0, from_first)):
        m = mask.to(g0.A.device).view(-1, 1, 1)
        child.append(g0.like(torch.where(m, g0.A, g1.A), torch.where(m, g0.B, g1.B)))
    return child


@register_operator("svd_crossover", kind="crossover", num_parents=2)
def svd_crossover(parents: Sequence[LoRAStack], *, generator: torch.Generator, k: int | None = None) -> LoRAStack:
    """X3 rank-preserving SVD-subspace crossover (ΔW space, gauge-invariant).

    Per module: SVD both parents, k ~ U{1..r−1} (or the given k in [0, r]); the child is components 1..k
    (largest first) of parents[0] plus components k+1..r of parents[1]: exactly r components. With r = 1 the
    random k is 1 (the fitter parent's component). Identical parents -> the parent's ΔW.
    """
    s0, s1 = parents
    child = []
    for g0, g1 in zip(s0, s1):
        n, r = g0.A.shape[0], g0.A.shape[1]
        if k is not None:
            _check(
                isinstance(k, int) and 0 <= k <= r, "svd_crossover", "k", f"must be an integer in [0, r={r}], got {k!r}"
            )
            split = torch.full((n, 1), k, device=g0.A.device)
        elif r == 1:
            split = torch.ones((n, 1), dtype=torch.long, device=g0.A.device)
        else:
            split = torch.randint(1, r, (n, 1), generator=generator, device=generator.device).to(g0.A.device)
        # One batched SVD over both parents.
        u, s, v = lora_svd(torch.cat([g0.A, g1.A]), torch.cat([g0.B, g1.B]))
        take0 = torch.arange(r, device=g0.A.device).unsqueeze(0) < split  # [n, r]
        u = torch.where(take0.unsqueeze(-2), u[:n], u[n:])
        v = torch.where(take0.unsqueeze(-2), v[:n], v[n:])
        s = torch.where(take0, s[:n], s[n:])
        child.append(g0.like(*factors_from_svd(u, s, v, a_row_rms(g0.A))))
    return child


@register_operator("extrapolative_crossover", kind="crossover", num_parents=2)
def extrapolative_crossover(
    parents: Sequence[LoRAStack], *, generator: torch.Generator, eta_min: float = 1.0, eta_max: float = 1.5
) -> LoRAStack:
    """X4 extrapolative crossover (factor space): θ = θ₁ + η·(θ₀ − θ₁), η ~ U(eta_min, eta_max), one η per child.

    parents[0] is the fitter parent, so η > 1 overshoots past it; η = 1 returns parents[0]. Set
    eta_min = eta_max for a fixed η.
    """
    _check(
        eta_min <= eta_max, "extrapolative_crossover", "eta_min", f"must be <= eta_max ({eta_max!r}), got {eta_min!r}"
    )
    eta = eta_min + (eta_max - eta_min) * float(torch.rand((), generator=generator, device=generator.device))
    # θ₁ + η(θ₀ − θ₁) written as θ₀ + (η − 1)(θ₀ − θ₁): the same number, but exactly θ₀ at η = 1.
    return [g0.like(g0.A + (eta - 1) * (g0.A - g1.A), g0.B + (eta - 1) * (g0.B - g1.B)) for g0, g1 in zip(*parents)]


MUTATIONS = tuple(n for n, op in OPERATORS.items() if op.kind == "mutation")
CROSSOVERS = tuple(n for n, op in OPERATORS.items() if op.kind == "crossover")
