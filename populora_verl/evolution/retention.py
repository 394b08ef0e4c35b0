"""Retention test: how much of a parent's skill survives each operator.

Right after an operator, evaluate parent and child with the same scorer and report ``child / parent`` per
operator (and per parameter setting). The scorer is any callable ``evaluate(state_dict) -> float`` where higher
is better and scores are positive (accuracy on a fixed problem set, ``exp(-loss)``, ...), so that the ratio reads
as "fraction of the parent's score retained". Crossovers need a second parent: pass one (then ``parent`` is
taken as the fitter ``parents[0]``), or let the harness make a perturbed copy of ``parent`` with
``full_gaussian`` (a sibling that shares its gauge, as PBT siblings do).

Every crossover is measured twice: with that **related** second parent, and with an **unrelated** one (pass
``unrelated_parent``, e.g. an adapter trained from another lora_A init; by default the related sibling written in
another gauge, ``A -> R A``, ``B -> B Rᵀ`` with a random orthogonal R per module: the same ΔW in unrelated
factors, which isolates what a factor-space crossover does to parents that do not share a gauge).

    rows = retention_test(adapter, evaluate, ["svd_mutation", ("svd_mutation", {"eps": 0.3}), "svd_crossover"])
    print(format_retention_table(rows))
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from .lora import delta_w_distance
from .operators import OPERATORS, get_operator

__all__ = ["RetentionRow", "retention_test", "format_retention_table", "OperatorSpec", "regauge"]

OperatorSpec = str | tuple[str, Mapping[str, Any]]


@dataclass
class RetentionRow:
    """One operator setting: the parent's score and its children's."""

    operator: str
    kind: str
    params: dict[str, Any]
    parent_score: float
    child_scores: list[float]
    delta_w_rel: float  # mean over children of ||ΔW_child − ΔW_parent|| / ||ΔW_parent|| (all modules, Frobenius)
    seconds: float  # mean operator wall time per child
    other_parent_score: float | None = None  # crossovers: the second parent's score
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def child_score(self) -> float:
        return statistics.fmean(self.child_scores)

    @property
    def retention(self) -> float:
        """Mean child score / parent score (NaN when the parent scores 0)."""
        return self.child_score / self.parent_score if self.parent_score != 0 else math.nan

    @property
    def min_retention(self) -> float:
        return min(self.child_scores) / self.parent_score if self.parent_score != 0 else math.nan


def _parse_spec(spec: OperatorSpec) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        return spec[0], dict(spec[1])
    raise TypeError(f"operator spec must be a name or (name, params), got {spec!r}")


def _device_of(adapter: Mapping[str, Tensor]) -> torch.device:
    return next(iter(adapter.values())).device


def regauge(adapter: Mapping[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
    """The same ΔW in other factors: ``A -> R A``, ``B -> B Rᵀ`` with a random r x r orthogonal R per module."""
    from .lora import orthonormalize, stack_adapter, unstack_adapter

    out = []
    for g in stack_adapter(adapter):
        n, r, _ = g.A.shape
        rot = orthonormalize(torch.randn((n, r, r), generator=generator, device=generator.device).to(g.A.device))
        out.append(g.like(rot @ g.A, g.B @ rot.transpose(-1, -2)))
    return unstack_adapter(out, adapter)


def retention_test(
    parent: Mapping[str, Tensor],
    evaluate: Callable[[dict[str, Tensor]], float],
    operators: Sequence[OperatorSpec] | None = None,
    *,
    second_parent: Mapping[str, Tensor] | None = None,
    second_parent_eps: float = 0.1,
    unrelated_parent: Mapping[str, Tensor] | None = None,
    children: int = 1,
    seed: int = 0,
) -> list[RetentionRow]:
    """Make ``children`` children per operator setting and score them against ``parent``.

    Crossover settings give two rows, ``extra["pair"]`` = ``related`` then ``unrelated`` (module docstring).

    ``operators``: names or ``(name, params)`` pairs; default every registered operator with its defaults.
    Child ``j`` of every setting uses a generator seeded ``seed + j`` (on the parent's device), so settings are
    compared on the same random draws where their formulas allow it.
    """
    if children < 1:
        raise ValueError(f"children must be >= 1, got {children!r}")
    specs = [_parse_spec(s) for s in (operators if operators is not None else list(OPERATORS))]
    for name, params in specs:
        op = get_operator(name)
        unknown = sorted(set(params) - set(op.defaults))
        if unknown:  # fail before spending time on evaluations
            raise TypeError(f"{name}: unknown parameter(s) {unknown}; accepted: {sorted(op.defaults)}")
    device = _device_of(parent)

    def generator(j: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed + j)

    parent_score = float(evaluate(dict(parent)))
    others: dict[str, tuple[Mapping[str, Tensor], float]] = {}
    if any(get_operator(n).kind == "crossover" for n, _ in specs):
        related = second_parent
        if related is None:
            related = get_operator("full_gaussian")([parent], generator=generator(10_007), eps=second_parent_eps)
        unrelated = unrelated_parent if unrelated_parent is not None else regauge(related, generator(20_011))
        others = {
            "related": (related, float(evaluate(dict(related)))),
            "unrelated": (unrelated, float(evaluate(dict(unrelated)))),
        }

    rows = []
    for name, params in specs:
        op = get_operator(name)
        for pair in [None] if op.num_parents == 1 else list(others):
            parents = [parent] if pair is None else [parent, others[pair][0]]
            scores, rel, secs = [], [], []
            for j in range(children):
                t0 = time.perf_counter()
                child = op(parents, generator=generator(j), **params)
                secs.append(time.perf_counter() - t0)
                dist, ref = delta_w_distance(child, parent)
                rel.append(dist / ref if ref > 0 else (0.0 if dist == 0 else math.inf))
                scores.append(float(evaluate(child)))
            rows.append(
                RetentionRow(
                    operator=name,
                    kind=op.kind,
                    params={**op.defaults, **params},
                    parent_score=parent_score,
                    child_scores=scores,
                    delta_w_rel=statistics.fmean(rel),
                    seconds=statistics.fmean(secs),
                    other_parent_score=None if pair is None else others[pair][1],
                    extra={} if pair is None else {"pair": pair},
                )
            )
    return rows


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def format_retention_table(rows: Sequence[RetentionRow], style: str = "markdown") -> str:
    """Render rows as a markdown table (``style="markdown"``) or aligned plain text (``style="plain"``)."""
    if style not in ("markdown", "plain"):
        raise ValueError(f"style must be 'markdown' or 'plain', got {style!r}")
    header = [
        "operator",
        "kind",
        "params",
        "parent",
        "child (mean)",
        "child/parent",
        "min child/parent",
        "|ΔW'-ΔW|/|ΔW|",
        "ms/child",
    ]
    body = [
        [
            r.operator,
            r.kind + (f" ({r.extra['pair']})" if r.extra.get("pair") else ""),
            ", ".join(f"{k}={v}" for k, v in r.params.items()) or "-",
            _fmt(r.parent_score),
            _fmt(r.child_score),
            _fmt(r.retention),
            _fmt(r.min_retention),
            _fmt(r.delta_w_rel, 3),
            _fmt(1000 * r.seconds, 3),
        ]
        for r in rows
    ]
    if style == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    fmt_row = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt_row(header), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in body])
