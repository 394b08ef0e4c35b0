"""verl's FSDP engine with resident adapters: one forward and backward per micro-batch for every slot in it.

The resident engine is ``FSDPEngineWithLMHead`` (or any subclass) with :class:`ResidentEngineMixin` mixed in front.
Where verl reads ``EngineConfig.engine_class`` (patch 0022) the trainer names :data:`ResidentFSDPEngineWithLMHead`
there and verl builds it; otherwise :func:`install` turns the worker's engine into a subclass of itself that mixes
it in. Either way :func:`install` attaches :class:`~populora_verl.workers.resident.ResidentAdapters` once it holds
the slots. Each batch carries a per-row tensor ``populora_slot``; the mixin

* forms the micro-batches with each slot's rows kept together (:func:`slot_partitions`): through verl's
  ``FSDPEngine.prepare_micro_batches`` where verl has that method (patch 0014), else by rebinding the module-level
  ``prepare_micro_batches`` of verl's FSDP engine module for the duration of ``forward_backward_batch``;
* tags each micro-batch's tokens with their slot before verl's forward (``forward_step``), and keeps the tag until
  the next micro-batch, so gradient checkpointing recomputes the same routing in backward;
* counts every slot's loss tokens and rows over the whole mini-batch on every data-parallel rank (one all-reduce),
  and calls verl's loss once per slot present in a micro-batch, on that slot's rows, with the slot's own counts as
  verl's ``batch_num_tokens`` / ``global_batch_size``: the sum is each slot's own token-mean loss;
* replaces verl's optimizer step (one global clip) by the per-slot clip and step of the resident optimizer, and
  verl's scheduler step by each trained slot's own schedule;
* runs the reference policy (``disable_adapter``) as the base model alone.

Per-slot loss metrics (``actor/pg_loss`` and the rest) are kept per slot for the worker
(:meth:`ResidentEngineMixin.populora_slot_metrics`); verl's own metrics stream gets the summed loss.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from populora_verl import verl_compat
from populora_verl.workers.adapter_bank import AdapterBankError
from populora_verl.workers.resident import ResidentAdapters, SlotRouting, base_only, set_routing

__all__ = [
    "SLOT_FIELD",
    "install",
    "ResidentEngineMixin",
    "RESIDENT_ENGINE_FQN",
    "row_token_counts",
    "select_rows",
    "select_tensordict_rows",
    "per_slot_loss",
    "slot_partitions",
    "MICRO_BATCH_ENV",
]

#: per-row tensor field naming each row's slot (added by the worker from the fused call's layout)
SLOT_FIELD = "populora_slot"


def row_token_counts(mask: torch.Tensor) -> torch.Tensor:
    """Tokens per row of a jagged nested mask (or a padded ``(rows, tokens)`` one)."""
    if not mask.is_nested:
        return mask.reshape(mask.shape[0], -1).sum(-1)
    vals, offs = mask.values(), mask.offsets()
    csum = torch.cat([vals.new_zeros(1), vals.cumsum(0)])
    return csum[offs[1:]] - csum[offs[:-1]]


def _run(rows: list[int]) -> tuple[int, int] | None:
    """``(first, end)`` when ``rows`` are consecutive (a slot's rows in the fused layout), else ``None``."""
    if rows and rows[-1] - rows[0] + 1 == len(rows) and all(b == a + 1 for a, b in zip(rows, rows[1:])):
        return rows[0], rows[-1] + 1
    return None


def _jagged_rows(
    vals: torch.Tensor, offs: torch.Tensor, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The values, offsets and lengths of ``rows`` of a jagged tensor: a view and a shifted slice of the offsets when
    the rows are consecutive, else one concatenation. The offsets are read once (one device round trip)."""
    bounds = offs.tolist()
    lengths = [bounds[i + 1] - bounds[i] for i in rows]
    run = _run(rows)
    if run is not None:
        start = bounds[run[0]]
        return vals[start : bounds[run[1]]], offs[run[0] : run[1] + 1] - start, lengths
    parts = [vals[bounds[i] : bounds[i + 1]] for i in rows]
    new_offs = torch.tensor([0, *itertools.accumulate(lengths)], device=offs.device, dtype=offs.dtype)
    return torch.cat(parts), new_offs, lengths


def _nested(vals: torch.Tensor, offs: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """A jagged tensor that knows its longest and shortest row. Without them torch pads it to its total length in
    ``to_padded_tensor`` (which verl's loss calls on old log-probs and advantages), not to its longest row."""
    return torch.nested.nested_tensor_from_jagged(vals, offs, min_seqlen=min(lengths), max_seqlen=max(lengths))


def select_rows(t: torch.Tensor, rows: list[int], offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a per-row output, keeping autograd: a jagged nested tensor (by its offsets), a packed
    ``(1, tokens)``/``(tokens,)`` tensor (by ``offsets``, the micro-batch's sequence offsets) or a padded one."""
    if t.is_nested:
        return _nested(*_jagged_rows(t.values(), t.offsets(), rows))
    if offsets is not None and t.dim() <= 2 and (t.dim() == 1 or t.shape[0] == 1):
        out, _, _ = _jagged_rows(t.reshape(-1), offsets, rows)
        return out.reshape(1, -1) if t.dim() == 2 else out
    run = _run(rows)
    return t[run[0] : run[1]] if run is not None else t[torch.as_tensor(rows, device=t.device)]


def select_tensordict_rows(data: Any, rows: list[int]) -> Any:
    """``rows`` of a micro-batch's TensorDict. Consecutive rows (a slot's rows in the fused layout) are sliced: views
    of every field, where verl's ``index_select_tensor_dict`` copies each one row by row; other rows go to it."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    run = _run(rows)
    if run is None:
        return tu.index_select_tensor_dict(data, rows)
    out = {}
    for key, t in data.items():
        if isinstance(t, torch.Tensor) and t.is_nested:
            if getattr(t, "_ragged_idx", 1) != 1 or getattr(t, "_lengths", None) is not None:
                return tu.index_select_tensor_dict(data, rows)  # a layout the slice does not cover
            out[key] = _nested(*_jagged_rows(t.values(), t.offsets(), rows))
        elif isinstance(t, torch.Tensor) or t.shape:
            out[key] = t[run[0] : run[1]]
        else:
            out[key] = t  # scalar metadata
    return TensorDict(source=out, batch_size=len(rows))


#: ``verl``: verl's own balanced micro-batches (rows of many slots in each), for an A/B of the micro-batching; the
#: default (unset or ``slot``) packs each slot's rows together.
MICRO_BATCH_ENV = "POPULORA_RESIDENT_MICRO_BATCHES"


def _pack(lengths: Sequence[int], bound: int) -> list[list[int]]:
    """Positions ``0..n-1`` cut into consecutive runs of at most ``bound`` tokens, each run as long as it can be
    (the fewest runs any cut of this order can have under ``bound``)."""
    parts: list[list[int]] = []
    used = bound + 1  # forces the first part
    for i, n in enumerate(lengths):
        if used + n > bound:
            parts.append([])
            used = 0
        parts[-1].append(i)
        used += n
    return parts


def slot_partitions(slots: Sequence[int], lengths: Sequence[int], max_tokens: int, count: int = 0) -> list[list[int]]:
    """Rows cut into micro-batches of at most ``max_tokens`` tokens, in slot order: each slot's rows stay together,
    so a micro-batch holds one or two slots where verl's balanced partition mixes many. As many micro-batches as
    packing them full needs (or ``count``, where another rank needs that many), with the tokens spread over them as
    evenly as the order allows: an update's peak memory grows with its largest micro-batch (activations and logits
    per token), and packing them full made that one up to a quarter larger than verl's balanced micro-batches of the
    same rows, in the same number (the single agent at 1.5B: two nearly full 16,384-token micro-batches and a small
    one, against three of about 13,100). An empty list when that cannot be done (fewer rows than ``count``) or a row
    is longer than ``max_tokens``."""
    if any(n > max_tokens for n in lengths) or not lengths:
        return []
    first: dict[int, int] = {}
    for i, k in enumerate(slots):
        first.setdefault(k, i)
    # slots in the order they first appear: rows already grouped by slot (the fused call's layout) keep their order,
    # so each micro-batch is a run of consecutive rows
    order = sorted(range(len(slots)), key=lambda i: (first[slots[i]], i))
    seq = [lengths[i] for i in order]
    count = max(count, len(_pack(seq, max_tokens)))
    if count > len(seq):
        return []
    # the smallest bound under which full packing needs no more than ``count`` parts: the least largest part of any
    # cut of this order into ``count`` parts (full packing needs fewer parts as the bound grows)
    lo, hi = max(max(seq), -(-sum(seq) // count)), max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_pack(seq, mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    parts = _pack(seq, lo)
    while len(parts) < count:  # split the part holding the most tokens at the row nearest its middle
        j = max((j for j, part in enumerate(parts) if len(part) > 1), key=lambda j: sum(seq[i] for i in parts[j]))
        part = parts[j]
        half, acc, cut = sum(seq[i] for i in part) / 2, 0, 1
        for cut in range(1, len(part)):
            acc += seq[part[cut - 1]]
            if acc >= half:
                break
        parts[j : j + 1] = [part[:cut], part[cut:]]
    return [[order[i] for i in part] for part in parts]


def _slot_micro_batching_on() -> bool:
    return os.environ.get(MICRO_BATCH_ENV, "slot") != "verl"


def _slot_micro_batches(
    data: Any,
    dp_group: Any = None,
    same_micro_num_in_dp: bool = True,
    *,
    verl_partition: Callable[[Any], Any] | None = None,
    **kwargs: Any,
):
    """verl's ``prepare_micro_batches`` with each slot's rows packed together (:func:`slot_partitions`), under the
    same token budget and, across data-parallel ranks, the same micro-batch count; verl's own where its micro-batching
    is not dynamic or a sequence is split across ranks (``verl_partition(data)`` where given, the engine's own split,
    else verl's module function with these arguments)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine import utils as engine_utils

    def verls():
        if verl_partition is not None:
            return verl_partition(data)
        return engine_utils.prepare_micro_batches(
            data, dp_group=dp_group, same_micro_num_in_dp=same_micro_num_in_dp, **kwargs
        )

    dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    sp_size = tu.get_non_tensor_data(data=data, key="sp_size", default=1)
    groups = tu.get_non_tensor_data(data=data, key="force_group_size", default=1)
    ids = data["input_ids"]
    verl_only = any(kwargs.get(k) is not None for k in ("num_batches_divided_by", "min_num_micro_batch"))
    if verl_only or not dynamic or sp_size != 1 or groups != 1 or SLOT_FIELD not in data.keys() or not ids.is_nested:
        return verls()
    max_tokens = int(data["max_token_len_per_gpu"])
    slots = data[SLOT_FIELD].reshape(-1).tolist()
    lengths = ids.offsets().diff().tolist()
    parts = slot_partitions(slots, lengths, max_tokens)
    # every rank runs the same number of micro-batches (verl's collectives in forward and backward pair up): the
    # largest count, which a rank reaches by splitting while it has at least that many rows; one all-reduce tells
    # every rank the count, whether every rank packed (no row over the budget) and the fewest rows on a rank
    agreed = torch.tensor([len(parts), -int(bool(parts)), -len(slots)], dtype=torch.long, device=_comm_device())
    if same_micro_num_in_dp and dp_group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    count, packed, fewest_rows = (int(v) for v in agreed.tolist())
    if packed != -1 or -fewest_rows < count:
        return verls()
    parts = slot_partitions(slots, lengths, max_tokens, count)
    return [select_tensordict_rows(data, part) for part in parts], parts


@contextlib.contextmanager
def _slot_micro_batching(enabled: bool):
    """verl's FSDP engine forms its micro-batches with :func:`_slot_micro_batches` inside the block: the runtime patch
    for a verl without ``FSDPEngine.prepare_micro_batches`` (0.9.1), which calls the module-level function."""
    if not enabled:
        yield
        return
    verl_compat.private_path("populora_verl.workers.resident_engine")
    from verl.workers.engine.fsdp import transformer_impl

    original = transformer_impl.prepare_micro_batches
    transformer_impl.prepare_micro_batches = _slot_micro_batches
    try:
        yield
    finally:
        transformer_impl.prepare_micro_batches = original


def _metric_parts(metrics: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """``name -> (aggregation, value)`` of one loss call's metrics (verl ``Metric`` objects or plain numbers)."""
    out = {}
    for name, m in metrics.items():
        agg = getattr(getattr(m, "aggregation", None), "value", "mean")
        values = getattr(m, "values", None)  # a verl Metric's list (a tensor's .values is a method)
        if isinstance(values, list):
            if not values:
                continue
            value = float(sum(values)) if agg == "sum" else float(sum(values) / len(values))
        elif torch.is_tensor(m) and m.numel() == 1:
            value = float(m.detach())
        elif isinstance(m, (int, float)):
            value = float(m)
        else:
            continue
        out[name] = (agg, value)
    return out


def per_slot_loss(
    loss_fn: Callable,
    slot_tokens: Mapping[int, float],
    slot_rows: Mapping[int, int],
    record: Callable[[int, Mapping[str, Any]], None],
    *,
    model_output: Mapping[str, Any],
    data: Any,
    dp_group: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's loss once per slot of a micro-batch on that slot's rows, normalised by the slot's own mini-batch
    tokens and rows; returns the sum and the last slot's metrics (each slot's go to ``record``)."""
    from verl.utils import tensordict_utils as tu

    slots = data[SLOT_FIELD].reshape(-1).tolist()
    rows_of: dict[int, list[int]] = {}
    for i, k in enumerate(slots):
        rows_of.setdefault(k, []).append(i)
    present = sorted(rows_of)
    whole = {key: tu.get_non_tensor_data(data, key, None) for key in ("batch_num_tokens", "global_batch_size")}
    offsets = data["input_ids"].offsets() if data["input_ids"].is_nested else None
    total, metrics = None, {}
    for k in present:
        rows = rows_of[k]
        if len(present) == 1:
            sub, out = data, model_output
        else:
            sub = select_tensordict_rows(data, rows)
            out = {
                name: (select_rows(v, rows, offsets) if torch.is_tensor(v) else v) for name, v in model_output.items()
            }
        tu.assign_non_tensor(sub, batch_num_tokens=max(float(slot_tokens[k]), 1.0), global_batch_size=int(slot_rows[k]))
        loss_k, metrics = loss_fn(model_output=out, data=sub, dp_group=dp_group)
        record(k, metrics)
        total = loss_k if total is None else total + loss_k
    tu.assign_non_tensor(data, **whole)  # the caller's micro-batch keeps the whole mini-batch's counts
    return total, metrics


class ResidentEngineMixin:
    """Mixed in front of verl's FSDP language-model engine by :func:`install` (see the module docstring)."""

    populora_resident: ResidentAdapters
    _populora_counts: tuple[dict[int, float], dict[int, int]] | None = None
    _populora_metrics: dict[int, dict[str, list[tuple[str, float]]]] | None = None
    _populora_norms: dict[int, float] | None = None
    _populora_trained: set[int] | None = None
    _populora_base_only: bool = False

    # --- batches -------------------------------------------------------------------------------------------------

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if self._populora_base_only:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if SLOT_FIELD not in data.keys():
            raise AdapterBankError(f"resident adapters: the batch has no '{SLOT_FIELD}' rows (which slot each row is)")
        store = self.populora_resident
        n = store.num_slots
        slots = data[SLOT_FIELD].reshape(-1).long()
        if not forward_only and loss_function is not None:
            device = data["loss_mask"].values().device if data["loss_mask"].is_nested else data["loss_mask"].device
            counts = torch.zeros(2, n, dtype=torch.float64, device=device)
            counts[0].index_add_(0, slots.to(device), row_token_counts(data["loss_mask"]).to(device, torch.float64))
            counts[1].index_add_(0, slots.to(device), torch.ones_like(slots, dtype=torch.float64, device=device))
            counts = counts.to(_comm_device())
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(counts, group=self.get_data_parallel_group())
            tokens = {k: float(counts[0, k]) for k in range(n) if counts[1, k] > 0}
            rows = {k: int(counts[1, k]) for k in range(n) if counts[1, k] > 0}
            self._populora_counts = (tokens, rows)
            self._populora_trained = set(rows)
            self._populora_metrics = {k: {} for k in rows}
            loss_function = functools.partial(per_slot_loss, loss_function, tokens, rows, self._record_slot_metrics)
        try:
            # where verl has the hook, it splits through prepare_micro_batches below: nothing to rebind
            rebind = _slot_micro_batching_on() and not verl_compat.has_engine_micro_batch_hook()
            with _slot_micro_batching(rebind):
                return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        finally:
            set_routing(None)

    def prepare_micro_batches(self, data):
        """verl's micro-batch split (``FSDPEngine.prepare_micro_batches``, which verl calls where it has it) with each
        slot's rows kept together: :func:`_slot_micro_batches`, falling back to verl's split; verl's own for the
        reference policy and under ``POPULORA_RESIDENT_MICRO_BATCHES=verl``."""
        verls = super().prepare_micro_batches
        if self._populora_base_only or not _slot_micro_batching_on():
            return verls(data)
        return _slot_micro_batches(
            data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True, verl_partition=verls
        )

    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._populora_base_only:
            set_routing(None)
            return super().forward_step(micro_batch, loss_function, forward_only)
        ids = micro_batch["input_ids"]
        if not ids.is_nested:
            raise AdapterBankError("resident adapters need actor_rollout_ref.model.use_remove_padding=true")
        lengths = ids.offsets().diff()
        # kept until the next micro-batch: gradient checkpointing recomputes this forward during backward
        # built where the forward runs (verl moves the micro-batch to the accelerator inside its forward_step)
        set_routing(
            SlotRouting.from_rows(
                micro_batch[SLOT_FIELD].reshape(-1), lengths, self.populora_resident.num_slots, device=_compute_device()
            )
        )
        return super().forward_step(micro_batch, loss_function, forward_only)

    def _record_slot_metrics(self, slot: int, metrics: Mapping[str, Any]) -> None:
        if self._populora_metrics is None:
            return
        bucket = self._populora_metrics.setdefault(slot, {})
        for name, part in _metric_parts(metrics).items():
            bucket.setdefault(name, []).append(part)

    # --- optimizer -----------------------------------------------------------------------------------------------

    def optimizer_zero_grad(self):
        super().optimizer_zero_grad()
        self.populora_resident.zero_grad()

    def optimizer_step(self):
        trained = sorted(self._populora_trained or ())
        norms = self.populora_resident.optimizer_step(self.optimizer_config.clip_grad, trained)
        self._populora_norms = norms
        finite = [v for v in norms.values() if math.isfinite(v)]
        return math.sqrt(sum(v * v for v in finite)) if finite else float("nan")

    def lr_scheduler_step(self):
        trained = sorted(self._populora_trained or ())
        self.populora_resident.advance_schedule()
        return self.populora_resident.learning_rate(trained[0]) if trained else 0.0

    # --- reference policy ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def disable_adapter(self):
        self._populora_base_only = True
        try:
            with base_only():
                yield
        finally:
            self._populora_base_only = False

    # --- per-slot results ----------------------------------------------------------------------------------------

    def populora_slot_metrics(self) -> dict[int, dict[str, float]]:
        """Each slot of the last update: its loss metrics reduced over micro-batches and data-parallel ranks, its
        gradient norm before clipping and the learning rate it trained with."""
        local = self._populora_metrics or {}
        names = sorted({(k, name) for k, bucket in local.items() for name in bucket})
        reduced: dict[int, dict[str, float]] = {k: {} for k in local}
        if names:
            values = torch.tensor([_reduce(local[k][name]) for k, name in names], dtype=torch.float64)
            if torch.distributed.is_initialized():
                group = self.get_data_parallel_group()
                world = torch.distributed.get_world_size(group)
                values = values.to(_comm_device())
                torch.distributed.all_reduce(values, group=group)
                means = torch.tensor([local[k][name][0][0] != "sum" for k, name in names], device=values.device)
                values = torch.where(means, values / world, values)
            for (k, name), v in zip(names, values.tolist(), strict=True):
                reduced[k][name] = v
        for k, norm in (self._populora_norms or {}).items():
            reduced.setdefault(k, {})["grad_norm"] = norm
            reduced[k]["lr"] = self.populora_resident.learning_rate(k)
        return reduced


def _reduce(parts: list[tuple[str, float]]) -> float:
    agg = parts[0][0]
    vals = [v for _, v in parts]
    return float(sum(vals)) if agg == "sum" else float(sum(vals) / len(vals))


def _compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm_device() -> torch.device:
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@functools.cache
def _resident_class(cls: type) -> type:
    return type(f"Resident{cls.__name__}", (ResidentEngineMixin, cls), {"__module__": __name__})


#: The resident FSDP language-model engine as verl builds it where verl reads ``EngineConfig.engine_class``
#: (patches/0022): the trainer names it in ``actor_rollout_ref.actor.fsdp_config.engine_class``.
RESIDENT_ENGINE_FQN = f"{__name__}.ResidentFSDPEngineWithLMHead"


def __getattr__(name: str) -> type:
    # Built on first use, not at import: importing verl's FSDP engine module is slow, and the helpers here (and the
    # driver, which only needs the name) do without it. _resident_class is cached, so this is the class install()
    # recognises and the one a swapped engine gets.
    if name == "ResidentFSDPEngineWithLMHead":
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        return _resident_class(FSDPEngineWithLMHead)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(engine: Any, store: ResidentAdapters) -> Any:
    """Give ``engine`` the resident behaviour: attach ``store``. An engine verl built as a resident class
    (``engine_class``) only gets the store; any other engine's class becomes a resident subclass of its own class,
    the runtime patch for a verl without ``EngineConfig.engine_class`` or a run that did not set it."""
    if not isinstance(engine, ResidentEngineMixin):
        verl_compat.private_path("populora_verl.workers.resident_engine")
        engine.__class__ = _resident_class(type(engine))
    engine.populora_resident = store
    return engine
