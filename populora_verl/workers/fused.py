"""One worker call for every adapter of a phase: lay the slots' batches out so verl's DP split stays per slot.

verl's ``make_nd_compute_dataproto_dispatch_fn`` cuts a batch into ``dp`` contiguous chunks (the first
``n % dp`` chunks one longer), one per data-parallel rank. A fused call sends all adapters' sub-batches at once, so
the keys are interleaved: rank r's chunk is slot a's r-th share, then slot b's r-th share, and so on. Every slot's
sub-batch is already a multiple of ``dp`` (verl's ``_balance_batch`` pads it), so every rank gets the same number of
rows per slot and runs the same sequence of per-slot forwards (a rank that ran a different number would hang FSDP's
collectives).

The layout travels as ``extra_info[SEGMENTS_KEY]``: a JSON list of ``{"slot", "rows", "size"}`` per segment in rank
order, where ``rows`` is the per-rank row count and ``size`` the slot's whole sub-batch (its PPO mini-batch).
Pure Python but :func:`fused_batch` (the trainer's side, over TransferQueue's ``KVBatchMeta``); the worker side
is :meth:`populora_verl.workers.worker.PopuLoRAActorRolloutRefWorker.compute_log_prob`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transfer_queue import KVBatchMeta

__all__ = [
    "SEGMENTS_KEY",
    "FUSED_KEY",
    "interleave",
    "encode_segments",
    "decode_segments",
    "rank_chunks",
    "segment_bounds",
]

#: ``extra_info`` entry that carries the fused layout (JSON; a list would be stacked per sample by TensorDict).
SEGMENTS_KEY = "populora_segments"
#: ``+trainer.populora_fused_rpc=false`` falls back to one compute_log_prob/update_actor call per adapter.
FUSED_KEY = "trainer.populora_fused_rpc"


def rank_chunks(n: int, dp: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each rank's chunk of ``n`` rows, as verl/TransferQueue's ``chunk(dp)`` cuts them."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    base, rem = divmod(n, dp)
    out, start = [], 0
    for r in range(dp):
        end = start + base + (1 if r < rem else 0)
        out.append((start, end))
        start = end
    return out


def interleave(parts: Sequence[tuple[int, Sequence[Any]]], dp: int) -> tuple[list[Any], list[dict[str, int]]]:
    """Fused row order for ``[(slot, rows), ...]`` and its segments (see the module docstring).

    Each slot's rows must be a multiple of ``dp``; a slot appears once. The slot's r-th share is the r-th contiguous
    chunk of its own rows, which is the share it would get from a call of its own.
    """
    seen: set[int] = set()
    segments, shares = [], []
    for slot, rows in parts:
        slot = int(slot)
        if slot in seen:
            raise ValueError(f"slot {slot} appears twice in one fused call")
        seen.add(slot)
        n = len(rows)
        if n == 0 or n % dp:
            raise ValueError(f"slot {slot}: {n} rows is not a positive multiple of the {dp} data-parallel ranks")
        segments.append({"slot": slot, "rows": n // dp, "size": n})
        shares.append([list(rows[a:b]) for a, b in rank_chunks(n, dp)])
    fused = [row for r in range(dp) for share in shares for row in share[r]]
    return fused, segments


def encode_segments(segments: Sequence[Mapping[str, int]]) -> str:
    return json.dumps([{"slot": int(s["slot"]), "rows": int(s["rows"]), "size": int(s["size"])} for s in segments])


def decode_segments(raw: Any) -> list[dict[str, int]]:
    """Segments from ``extra_info`` (a JSON string; a one-element per-sample stack of it is accepted too)."""
    if isinstance(raw, (list, tuple)) and raw and all(isinstance(x, str) for x in raw):
        if any(x != raw[0] for x in raw):
            raise ValueError("fused call carries different segment layouts per sample")
        raw = raw[0]
    try:
        segs = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        out = [{"slot": int(s["slot"]), "rows": int(s["rows"]), "size": int(s["size"])} for s in segs]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{SEGMENTS_KEY} is not a segment list: {raw!r:.200}") from e
    if not out or any(s["rows"] < 1 or s["size"] < s["rows"] for s in out):
        raise ValueError(f"{SEGMENTS_KEY} has an empty or inconsistent segment: {out}")
    return out


def segment_bounds(n_rows: int, segments: Sequence[Mapping[str, int]]) -> list[tuple[int, int, int, int]]:
    """``(slot, start, end, size)`` of each segment inside one rank's ``n_rows`` rows; raises if they don't add up."""
    total = sum(int(s["rows"]) for s in segments)
    if total != n_rows:
        raise ValueError(f"fused call: segments cover {total} rows but this rank got {n_rows}")
    out, start = [], 0
    for s in segments:
        end = start + int(s["rows"])
        out.append((int(s["slot"]), start, end, int(s["size"])))
        start = end
    return out


def fused_batch(subs: Mapping[int, KVBatchMeta], dp: int) -> KVBatchMeta:
    """All slots' balanced sub-batches as one call's batch, laid out per :func:`interleave`.

    Each slot keeps its own keys (and verl's balanced order, so each rank gets the share it would get alone)."""
    from transfer_queue import KVBatchMeta  # the trainer's side only: the worker decodes without TransferQueue

    if not subs:
        raise ValueError("fused_batch: no slot to train")
    parts = [(slot, list(zip(sub.keys, sub.tags, strict=True))) for slot, sub in subs.items()]
    rows, segments = interleave(parts, dp)
    first = next(iter(subs.values()))
    batch = KVBatchMeta(partition_id=first.partition_id, keys=[k for k, _ in rows], tags=[t for _, t in rows])
    batch.extra_info[SEGMENTS_KEY] = encode_segments(segments)
    return batch
