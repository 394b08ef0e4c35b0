"""The fused per-phase worker call: layout (driver) and per-slot dispatch (worker), on CPU with fakes for verl's
FSDP bodies. Compute matching: every slot trains on exactly the rows, and every rank on exactly the share, that one
call per slot would give it."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from populora_verl.workers import fused


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_interleave_gives_each_rank_its_per_slot_share(dp):
    rng = random.Random(dp)
    parts = [(slot, [f"s{slot}k{i}" for i in range(dp * rng.randint(1, 5))]) for slot in (3, 0, 5)]
    rows, segs = fused.interleave(parts, dp)
    assert sorted(rows) == sorted(k for _, ks in parts for k in ks)  # same rows, nothing duplicated or lost
    assert [s["slot"] for s in segs] == [3, 0, 5]
    own = {slot: [ks[a:b] for a, b in fused.rank_chunks(len(ks), dp)] for slot, ks in parts}
    for r, (a, b) in enumerate(fused.rank_chunks(len(rows), dp)):  # verl's dispatch: contiguous chunks
        chunk = rows[a:b]
        for slot, lo, hi, size in fused.segment_bounds(len(chunk), segs):
            assert chunk[lo:hi] == own[slot][r]
            assert size == len(dict(parts)[slot])


def test_interleave_rejects_unbalanced_or_repeated_slots():
    with pytest.raises(ValueError, match="multiple of the 2"):
        fused.interleave([(0, ["a", "b", "c"])], 2)
    with pytest.raises(ValueError, match="twice"):
        fused.interleave([(0, ["a"]), (0, ["b"])], 1)
    with pytest.raises(ValueError, match="multiple"):
        fused.interleave([(1, [])], 1)


def test_segments_round_trip_and_validation():
    segs = [{"slot": 2, "rows": 3, "size": 6}, {"slot": 0, "rows": 1, "size": 2}]
    enc = fused.encode_segments(segs)
    assert fused.decode_segments(enc) == segs
    assert fused.decode_segments([enc, enc]) == segs  # a per-sample stack of the same string
    for bad in ("nope", "[]", '[{"slot": 1, "rows": 0, "size": 1}]', '[{"slot": 1}]', 7):
        with pytest.raises(ValueError):
            fused.decode_segments(bad)
    with pytest.raises(ValueError, match="cover 4 rows"):
        fused.segment_bounds(5, segs)


# --- worker side ---------------------------------------------------------------------------------------------------


class _Bank:
    def __init__(self):
        self.log: list[tuple[int, bool]] = []

    @contextlib.contextmanager
    def active(self, slot, *, train=True):
        self.log.append((slot, train))
        yield slot


def _td(n: int, extra: dict):
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    lens = [3 + i for i in range(n)]
    td = TensorDict({"input_ids": torch.nested.as_nested_tensor([torch.full((k,), i) for i, k in enumerate(lens)],
                                                                 layout=torch.jagged),
                     "row": torch.arange(n)}, batch_size=n)
    tu.assign_non_tensor(td, **extra)
    return td


@pytest.fixture
def worker(monkeypatch):
    pytest.importorskip("verl")
    from verl.utils import tensordict_utils as tu

    from populora_verl.workers import worker as wmod

    seen = []

    class _Parent:  # verl's bodies: log-probs per row, update metrics per call
        def compute_log_prob(self, data):
            seen.append(("logp", self.bank.log[-1][0], data["row"].tolist(), tu.get(data, "temperature")))
            out = tu.get_tensordict({"log_probs": torch.nested.as_nested_tensor(
                [x.float() * -0.1 for x in data["input_ids"].unbind()], layout=torch.jagged)},
                non_tensor_dict={"metrics": {"n": len(data["row"])}})
            return out

        def update_actor(self, data):
            seen.append(("update", self.bank.log[-1][0], data["row"].tolist(),
                         tu.get(data, "mini_batch_size"), tu.get(data, "global_batch_size")))
            return tu.get_tensordict({}, non_tensor_dict={"metrics": {"pg_loss": [float(data["row"].sum())]}})

    monkeypatch.setattr(wmod, "ActorRolloutRefWorker", _Parent)
    w = wmod.PopuLoRAActorRolloutRefWorker.__new__(wmod.PopuLoRAActorRolloutRefWorker)
    w.bank = _Bank()
    return w, seen


def test_worker_fused_log_probs_run_per_slot_and_come_back_in_row_order(worker):
    from verl.utils import tensordict_utils as tu

    w, seen = worker
    segs = [{"slot": 2, "rows": 2, "size": 4}, {"slot": 0, "rows": 3, "size": 6}]
    td = _td(5, {fused.SEGMENTS_KEY: fused.encode_segments(segs), "temperature": 0.7})
    out = w._fused(td, fused.decode_segments(tu.pop(td, fused.SEGMENTS_KEY)), train=False)
    assert seen == [("logp", 2, [0, 1], 0.7), ("logp", 0, [2, 3, 4], 0.7)]
    assert w.bank.log == [(2, False), (0, False)]
    got = [t.tolist() for t in out["log_probs"].unbind()]
    want = [[round(-0.1 * i, 6)] * (3 + i) for i in range(5)]
    assert [[round(x, 6) for x in row] for row in got] == want


def test_worker_fused_update_sets_each_slots_mini_batch_and_returns_metrics_per_slot(worker):
    w, seen = worker
    segs = [{"slot": 1, "rows": 1, "size": 2}, {"slot": 3, "rows": 2, "size": 4}]
    td = _td(3, {fused.SEGMENTS_KEY: fused.encode_segments(segs), "mini_batch_size": 99, "global_batch_size": 99,
                 "populora_adapter": 7})
    out = w.update_actor(td)  # through verl's @register wrapper, as the driver reaches it
    assert seen == [("update", 1, [0], 2, 2), ("update", 3, [1, 2], 4, 4)]
    assert w.bank.log == [(1, True), (3, True)]
    from verl.utils import tensordict_utils as tu

    assert tu.get(out, "metrics") == {"populora_fused": {"1": {"pg_loss": [0.0]}, "3": {"pg_loss": [3.0]}}}


def test_worker_fused_refuses_a_layout_that_does_not_cover_its_rows(worker):
    w, _ = worker
    with pytest.raises(ValueError, match="cover"):
        w._fused(_td(4, {}), [{"slot": 0, "rows": 3, "size": 3}], train=True)
