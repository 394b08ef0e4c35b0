"""The adapter bank under FSDP2 sharding on a real 2-process gloo group (CPU): populora_verl.workers.shard_check.

Two spawned ranks wrap a tiny PEFT Qwen2 with verl's ``apply_fsdp2`` (uneven ``Shard(0)`` shards over both ranks, then
HSDP: replicated over 2, one shard group per rank) and run per-slot
training, forwards, verl's LoRA gather for the weight sync, per-rank save/load and evolution; rank 0 also runs the
unsharded reference. One spawn serves every test; the module skips when gloo is unavailable.
"""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from populora_verl.workers import shard_check  # noqa: E402

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, shard_check.Check]:
    import torch.multiprocessing as mp

    outdir = str(tmp_path_factory.mktemp("gloo_bank"))
    # Spawned ranks, not forks of a fork server that preloaded torch, transformers and verl: on a loaded machine a
    # rank forked from that server once aborted at start ("malloc(): unaligned tcache chunk detected"), the mark
    # of a fork taken while a thread of those imports held the allocator's lock. Each rank pays the imports instead.
    # Ranks record their own failures; a crash shows up as a missing result file, named by check_results.
    mp.start_processes(shard_check.run_rank, args=(WORLD, outdir, "gloo", _free_port()), nprocs=WORLD,
                       join=True, start_method="spawn")
    return {c.name: c for c in shard_check.check_results(shard_check.load_results(outdir, WORLD))}


LAYOUTS = [shard_check.layout_name(WORLD, f) for f in shard_check.layouts(WORLD)]  # FSDP over 2, HSDP 2 x 1


def _assert(checks: dict[str, shard_check.Check], name: str) -> None:
    """``name`` passed under every mesh layout (verl's FSDP over all ranks, and HSDP)."""
    assert checks["ranks ran every scenario"].ok, checks["ranks ran every scenario"].detail
    for layout in LAYOUTS:
        c = checks[f"{layout}: {name}"]
        assert c.ok, f"{c.name}: {c.detail}"


def test_both_mesh_layouts_ran(checks):
    assert LAYOUTS == ["FSDP over 2", "HSDP 2 x 1"]
    assert all(any(n.startswith(f"{layout}: ") for n in checks) for layout in LAYOUTS)


def test_shards_are_uneven(checks):
    _assert(checks, "FSDP2 shards are uneven across ranks (the hard case)")


def test_init_slots_identical_on_every_rank(checks):
    _assert(checks, "init_slots: identical full adapters on every rank, equal to one process")


def test_training_a_slot_touches_only_that_slot(checks):
    _assert(checks, "training a slot changes only that slot's shards on every rank")
    _assert(checks, "per-slot optimizer step counts on every rank")


def test_sharded_training_matches_one_process(checks):
    _assert(checks, "sharded per-slot AdamW training equals one process on the whole batch")
    _assert(checks, "trained adapters bit-identical across ranks")
    _assert(checks, "forward under each swapped-in slot equals one process")


def test_weight_sync_gathers_same_full_adapters_on_every_rank(checks):
    _assert(checks, "weight sync (verl collect_lora_params) gives the slot's full adapter on every rank")


def test_sharded_bank_save_load(checks):
    _assert(checks, "per-rank bank files save and load exactly")
    _assert(checks, "a bank saved at another world size is refused")


def test_evolution_identical_on_every_rank(checks):
    _assert(checks, "evolution (apply_plan): same children on every rank, equal to one process")
    _assert(checks, "a child sent to every rank is resharded into exact slices and trains from a fresh optimizer")


def test_check_results_reports_a_failing_rank():
    # The checker itself: a rank that recorded an error (or never wrote its file) fails the run by name.
    found = [{"rank": 0, "error": "Traceback: boom"}, {"rank": 1, "error": "no result file"}]
    (only,) = shard_check.check_results(found)
    assert not only.ok and "rank 0" in only.detail and "boom" in only.detail
