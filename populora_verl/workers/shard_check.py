"""Self-check of the adapter bank under FSDP2 sharding, on W real processes (gloo on CPU, NCCL on GPUs).

Every rank wraps the same tiny PEFT Qwen2 with verl's own ``apply_fsdp2`` (``fully_shard`` per decoder layer and on
the root: ``Shard(0)`` DTensors; ``r=3`` and the 45-wide ``up_proj`` make the shards uneven, and empty on some ranks
once W > 3) and runs the paths the multi-GPU trainer relies on:

* per-slot training with each rank feeding its own data-parallel share (only the trained slot may change),
* a forward under every slot (the copy into the local shard is what FSDP all-gathers),
* the weight sync's gather of the live adapter (verl's ``collect_lora_params``, plain and layered),
* save / load of per-rank bank files, and the refusal of a bank saved at another world size,
* evolution inside the bank (``apply_plan``, the trainer's way) and a full state sent to every rank
  (``populora_set_adapter``).

Rank 0 also runs the unsharded reference (one process, every rank's data concatenated), so sharded numbers are
checked against single-GPU numbers, not only against each other. Each rank writes what it found to
``OUT/rank{r}.pt``; :func:`check_results` turns those into named pass/fail checks. CI runs it on a 2-process gloo
group (``tests/workers/test_bank_sharded_gloo.py``); on a GPU node::

    torchrun --standalone --nproc-per-node 2 -m populora_verl.workers.shard_check --out /tmp/shard_check

prints one line per check and exits non-zero if one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Check", "layouts", "layout_name", "run_rank", "check_results", "main", "NUM_SLOTS", "TRAIN_ORDER"]

LR = 1e-2
NUM_SLOTS = 3
TRAIN_ORDER = (0, 1, 0, 2, 1)  # interleaved, so every swap crosses slots that have live optimizer state
VOCAB, SEQ = 96, 10
#: Sharded vs one-process AdamW results: the gradient mean over ranks is the same sum in another order.
RTOL, ATOL = 1e-4, 1e-5


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


# --- shared by every rank and the reference ----------------------------------------------------------------------


def _tiny_peft_model(device: torch.device) -> torch.nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # identical on every rank: FSDP2 then keeps each rank's slice of the same weights
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=30,
        intermediate_size=45,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    lora = LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora).to(device)


def _opt(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    # verl builds one AdamW over every parameter and a per-step LR schedule; the bank swaps both per slot.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def _ids(step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s data-parallel share of step ``step`` (equal lengths: FSDP's mean of means is the mean)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g).to(device)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _plan() -> list[dict[str, Any]]:
    # An SVD crossover and an elementwise mutation; slot 0 is a parent of the first child and the second child.
    return [
        {"child_slot": 2, "operator": "svd_crossover", "parent_slots": [0, 1], "seed": 11},
        {"child_slot": 0, "operator": "layer_gaussian", "parent_slots": [1], "seed": 12},
    ]


def _slot_logits(bank: Any, model: Any, device: Any) -> list[Any]:
    """The probe's logits under every slot, each swapped in for inference."""
    out = []
    for k in range(NUM_SLOTS):
        bank.swap_in(k, train=False)
        out.append(_probe_logits(model, device))
    return out


def _probe_logits(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids(99, 0, device)).logits.detach().float().cpu()


def _locals(bank: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {k: {n: t.clone() for n, t in bank._slots[k].params.items()} for k in range(bank.num_slots)}


def _same_locals(
    a: Mapping[int, Mapping[str, torch.Tensor]], b: Mapping[int, Mapping[str, torch.Tensor]], slot: int
) -> bool:
    return all(torch.equal(a[slot][n], b[slot][n]) for n in a[slot])


# --- the reference: one process, no sharding ---------------------------------------------------------------------


def _reference(world: int, device: torch.device) -> dict[str, Any]:
    from populora_verl.workers.adapter_bank import AdapterBank

    model = _tiny_peft_model(device)
    opt, sched = _opt(model)
    bank = AdapterBank(model, opt, sched)
    bank.init_slots(NUM_SLOTS, seed=5)
    out: dict[str, Any] = {"init": [bank.get_adapter_state(k) for k in range(NUM_SLOTS)]}
    for step, slot in enumerate(TRAIN_ORDER):
        with bank.active(slot):
            _train(model, opt, sched, torch.cat([_ids(step, r, device) for r in range(world)]))
    out["trained"] = [bank.get_adapter_state(k) for k in range(NUM_SLOTS)]
    out["optimizer_steps"] = [bank.slot_info(k)["optimizer_step"] for k in range(NUM_SLOTS)]
    out["logits"] = _slot_logits(bank, model, device)
    bank.apply_plan(_plan())
    out["evolved"] = [bank.get_adapter_state(k) for k in range(NUM_SLOTS)]
    return out


# --- one rank ------------------------------------------------------------------------------------------------------


def layouts(world: int) -> list[int]:
    """FSDP sizes to check: every rank shards each adapter (verl's default), and HSDP with half the ranks per shard
    group (``actor.fsdp_config.fsdp_size``, e.g. one group per node), whose placements are (Replicate, Shard)."""
    return [world] + ([world // 2] if world % 2 == 0 else [])


def layout_name(world: int, fsdp_size: int) -> str:
    return f"FSDP over {world}" if fsdp_size == world else f"HSDP {world // fsdp_size} x {fsdp_size}"


def _scenarios(rank: int, world: int, device: torch.device, outdir: str, fsdp_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from verl.utils.fsdp_utils import apply_fsdp2, collect_lora_params

    from populora_verl.workers.adapter_bank import AdapterBank, AdapterBankError, bank_filename

    # The meshes verl's FSDP engine builds (create_device_mesh): 1-D, or (ddp, fsdp) when fsdp_size < world.
    if fsdp_size == world:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    else:
        mesh = init_device_mesh(device.type, (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))
    model = _tiny_peft_model(device)
    apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})  # verl's own FSDP2 wrapping
    opt, sched = _opt(model)
    bank = AdapterBank(model, opt, sched)
    out: dict[str, Any] = {"rank": rank, "world": world, "fsdp_size": fsdp_size, "device": str(device)}
    out["placements"] = sorted({str(p.placements) for p in bank._params.values()})
    out["local_rows"] = {n: int(p.to_local().shape[0]) for n, p in bank._params.items()}
    out["full_rows"] = {n: int(p.shape[0]) for n, p in bank._params.items()}

    bank.init_slots(NUM_SLOTS, seed=5)
    out["init"] = [bank.get_adapter_state(k) for k in range(NUM_SLOTS)]

    untouched_ok, trained_changed = True, True
    for step, slot in enumerate(TRAIN_ORDER):
        before, sums_before = _locals(bank), bank.shard_checksums()
        with bank.active(slot):
            _train(model, opt, sched, _ids(step, rank, device))
        after, sums_after = _locals(bank), bank.shard_checksums()
        for k in range(NUM_SLOTS):
            same = _same_locals(before, after, k)
            if (sums_before[k] == sums_after[k]) != same:  # the checksum the GPU proof logs must agree
                untouched_ok = trained_changed = False
            if k == slot:
                # A rank whose shard of every tensor is empty has nothing that could change.
                trained_changed &= (not same) or all(t.numel() == 0 for t in after[k].values())
            else:
                untouched_ok &= same
    out["untouched_bit_identical"] = untouched_ok
    out["trained_slot_changed"] = trained_changed
    out["trained"] = [bank.get_adapter_state(k) for k in range(NUM_SLOTS)]
    out["optimizer_steps"] = [bank.slot_info(k)["optimizer_step"] for k in range(NUM_SLOTS)]

    out["logits"] = _slot_logits(bank, model, device)

    # The weight sync as the worker runs it: per slot, verl's gather of the live adapter; no slot may change.
    locals_before, versions_before = _locals(bank), [bank.version(k) for k in range(NUM_SLOTS)]
    out["sync"], out["sync_layered"] = [], []
    for k in range(NUM_SLOTS):
        with bank.active(k, train=False):
            out["sync"].append(
                {n: t.detach().cpu().clone() for n, t in collect_lora_params(model, False, True).items()}
            )
            out["sync_layered"].append(
                {n: t.detach().cpu().clone() for n, t in collect_lora_params(model, True, True).items()}
            )
    locals_after = _locals(bank)
    out["sync_left_slots_alone"] = versions_before == [bank.version(k) for k in range(NUM_SLOTS)] and all(
        _same_locals(locals_before, locals_after, k) for k in range(NUM_SLOTS)
    )

    # Per-rank bank files, loaded into a fresh bank over the same sharded model.
    ckpt = os.path.join(outdir, f"bank_fsdp{fsdp_size}")
    os.makedirs(ckpt, exist_ok=True)
    path = os.path.join(ckpt, bank_filename(world, rank))
    bank.save(path)
    dist.barrier()
    out["bank_files"] = sorted(os.listdir(ckpt))
    fresh = AdapterBank(model, opt, sched)
    fresh.load(path)
    out["loaded"] = [fresh.get_adapter_state(k) for k in range(NUM_SLOTS)]
    out["loaded_optimizer_steps"] = [fresh.slot_info(k)["optimizer_step"] for k in range(NUM_SLOTS)]
    a, b = bank.state_dict(), fresh.state_dict()
    out["loaded_local_state_equal"] = all(
        torch.equal(sa["params"][n], sb["params"][n]) for sa, sb in zip(a["slots"], b["slots"]) for n in sa["params"]
    ) and all(
        torch.equal(v, sb["optim"][n][key]) if torch.is_tensor(v) else v == sb["optim"][n][key]
        for sa, sb in zip(a["slots"], b["slots"])
        for n, st in (sa["optim"] or {}).items()
        for key, v in st.items()
    )
    # A bank file written by one unsharded process does not fit a rank's shard: refused, never half-loaded.
    unsharded_model = _tiny_peft_model(device)
    unsharded = AdapterBank(unsharded_model, *_opt(unsharded_model))
    unsharded.init_slots(NUM_SLOTS, seed=5)
    other = os.path.join(outdir, f"unsharded_fsdp{fsdp_size}_rank{rank}.pt")
    unsharded.save(other)
    try:
        fresh.load(other)
        out["world_size_change"] = "accepted"
    except AdapterBankError as e:
        out["world_size_change"] = str(e)
    del unsharded, unsharded_model

    # Evolution in the bank, with a dirty live slot (1) that is also a parent: its latest weights must be used.
    bank.swap_in(1)
    bank.apply_plan(_plan())
    out["evolved"] = [bank.get_adapter_state(k) for k in range(NUM_SLOTS)]
    out["evolved_versions"] = [bank.version(k) for k in range(NUM_SLOTS)]
    out["evolved_optimizer_steps"] = [bank.slot_info(k)["optimizer_step"] for k in range(NUM_SLOTS)]
    # populora_set_adapter: a state made once on the driver and sent, full, to every rank.
    child = {k: v * 0.5 + 0.25 for k, v in out["evolved"][1].items()}
    bank.set_adapter_state(1, child, reset_optimizer=True)
    out["set_child"], out["set_child_expected"] = bank.get_adapter_state(1), child
    shard_ok = True
    for n, p in bank._params.items():
        full = child[bank._keys[n]].to(device=device, dtype=p.dtype)
        expected = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local().cpu()
        shard_ok &= torch.equal(bank._slots[1].params[n], expected)
    out["child_shards_are_slices"] = shard_ok
    with bank.active(1):
        _train(model, opt, sched, _ids(50, rank, device))
    out["post_evolution_step"] = bank.slot_info(1)["optimizer_step"]
    return out


def run_rank(rank: int, world: int, outdir: str, backend: str = "gloo", port: int | None = None) -> None:
    """Join the process group, run every scenario, write ``outdir/rank{rank}.pt`` (an ``error`` key on failure)."""
    import torch.distributed as dist

    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Only verl's FSDP helpers are needed: skip loading verl plugins (ours included) in every rank.
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    torch.set_num_threads(1)  # tiny tensors: W ranks on few cores must not oversubscribe them
    start = time.perf_counter()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    # A rank that dies mid-collective leaves the others waiting: bound the wait instead of hanging a CI job.
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180))
    found: dict[str, Any] = {"rank": rank}
    try:
        found["layouts"] = {f: _scenarios(rank, world, device, outdir, f) for f in layouts(world)}
        if rank == 0:
            found["reference"] = _reference(world, device)
        found["seconds"] = time.perf_counter() - start
    except BaseException:  # recorded, so the checks name the failing rank instead of a bare exit code
        found["error"] = traceback.format_exc()
    finally:
        torch.save(found, os.path.join(outdir, f"rank{rank}.pt"))
        if "error" not in found:
            dist.barrier()  # every file is written before rank 0 reads them
        dist.destroy_process_group()


# --- checks ------------------------------------------------------------------------------------------------------


def _diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], *, exact: bool) -> str:
    """'' if the two state dicts agree (bit-exact or within RTOL/ATOL), else the first disagreement."""
    if set(a) != set(b):
        return f"keys differ: {sorted(set(a) ^ set(b))[:3]}"
    for k in sorted(a):
        x, y = a[k].float().cpu(), b[k].float().cpu()
        if x.shape != y.shape:
            return f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if exact and not torch.equal(x, y):
            return f"{k}: max |diff| {float((x - y).abs().max()):.3g} (bit-exact expected)"
        if not exact and not torch.allclose(x, y, rtol=RTOL, atol=ATOL):
            return f"{k}: max |diff| {float((x - y).abs().max()):.3g}"
    return ""


def _all(name: str, problems: Sequence[str]) -> Check:
    bad = [p for p in problems if p]
    return Check(name, not bad, "; ".join(bad[:3]))


def check_results(found: Sequence[Mapping[str, Any]]) -> list[Check]:
    """Named checks over every rank's findings (rank 0 carries the unsharded reference), per mesh layout; each name
    starts with the layout, e.g. ``FSDP over 2: ...``."""
    errors = [f"rank {f.get('rank', i)}:\n{f['error']}" for i, f in enumerate(found) if "error" in f]
    if errors:
        return [Check("ranks ran every scenario", False, "\n".join(errors))]
    world = len(found)
    checks = [Check("ranks ran every scenario", True)]
    for fsdp_size in layouts(world):
        per_rank = [f["layouts"][fsdp_size] for f in found]
        prefix = layout_name(world, fsdp_size)
        checks += [
            Check(f"{prefix}: {c.name}", c.ok, c.detail)
            for c in _layout_checks(per_rank, found[0]["reference"], fsdp_size)
        ]
    return checks


def _layout_checks(found: Sequence[Mapping[str, Any]], ref: Mapping[str, Any], fsdp_size: int) -> list[Check]:
    world = len(found)
    r = range(NUM_SLOTS)
    steps = [TRAIN_ORDER.count(k) for k in r]
    sharded = fsdp_size > 1  # a shard group of one rank holds whole tensors: nothing uneven, any bank file fits
    checks = [
        _all(
            "FSDP2 shards are uneven across ranks (the hard case)",
            [
                ""
                if not sharded or any(f["local_rows"][n] * fsdp_size != f["full_rows"][n] for n in f["local_rows"])
                else ""
                if any(f["local_rows"][n] * world != f["full_rows"][n] for n in f["local_rows"])
                else f"rank {f['rank']}: every shard is even"
                for f in found
            ],
        ),
        _all(
            "init_slots: identical full adapters on every rank, equal to one process",
            [_diff(f["init"][k], ref["init"][k], exact=True) for f in found for k in r],
        ),
        _all(
            "training a slot changes only that slot's shards on every rank",
            [
                ""
                if f["untouched_bit_identical"] and f["trained_slot_changed"]
                else f"rank {f['rank']}: untouched={f['untouched_bit_identical']} "
                f"trained_changed={f['trained_slot_changed']}"
                for f in found
            ],
        ),
        _all(
            "per-slot optimizer step counts on every rank",
            [
                ""
                if f["optimizer_steps"] == ref["optimizer_steps"] == steps
                else f"rank {f['rank']}: {f['optimizer_steps']}"
                for f in found
            ],
        ),
        _all(
            "sharded per-slot AdamW training equals one process on the whole batch",
            [_diff(f["trained"][k], ref["trained"][k], exact=False) for f in found for k in r],
        ),
        _all(
            "trained adapters bit-identical across ranks",
            [_diff(f["trained"][k], found[0]["trained"][k], exact=True) for f in found for k in r],
        ),
        _all(
            "forward under each swapped-in slot equals one process",
            [_diff({"logits": f["logits"][k]}, {"logits": ref["logits"][k]}, exact=False) for f in found for k in r],
        ),
        _all(
            "weight sync (verl collect_lora_params) gives the slot's full adapter on every rank",
            [
                _diff(f[key][k], f["trained"][k], exact=True)
                for f in found
                for k in r
                for key in ("sync", "sync_layered")
            ]
            + ["" if f["sync_left_slots_alone"] else f"rank {f['rank']}: sync changed a slot" for f in found],
        ),
        _all(
            "per-rank bank files save and load exactly",
            [
                ""
                if f["bank_files"] == [f"bank_world_size_{world}_rank_{i}.pt" for i in range(world)]
                else f"rank {f['rank']}: files {f['bank_files']}"
                for f in found
            ]
            + [
                ""
                if f["loaded_local_state_equal"] and f["loaded_optimizer_steps"] == f["optimizer_steps"]
                else f"rank {f['rank']}: loaded state differs"
                for f in found
            ]
            + [_diff(f["loaded"][k], f["trained"][k], exact=True) for f in found for k in r],
        ),
        _all(
            "a bank saved at another world size is refused",
            [
                ""
                if not sharded or "world size or sharding changed" in f["world_size_change"]
                else f"rank {f['rank']}: {f['world_size_change'][:200]}"
                for f in found
            ],
        ),
        _all(
            "evolution (apply_plan): same children on every rank, equal to one process",
            [_diff(f["evolved"][k], ref["evolved"][k], exact=False) for f in found for k in r]
            + [_diff(f["evolved"][k], found[0]["evolved"][k], exact=True) for f in found for k in r]
            + [
                ""
                if f["evolved_versions"] == [1, 0, 1] and f["evolved_optimizer_steps"] == [0, steps[1], 0]
                else f"rank {f['rank']}: versions {f['evolved_versions']} steps {f['evolved_optimizer_steps']}"
                for f in found
            ],
        ),
        _all(
            "a child sent to every rank is resharded into exact slices and trains from a fresh optimizer",
            [_diff(f["set_child"], f["set_child_expected"], exact=True) for f in found]
            + [
                ""
                if f["child_shards_are_slices"] and f["post_evolution_step"] == 1
                else f"rank {f['rank']}: slices={f['child_shards_are_slices']} step={f['post_evolution_step']}"
                for f in found
            ],
        ),
    ]
    if not sharded:  # say so rather than pass silently
        vacuous = (
            "FSDP2 shards are uneven across ranks (the hard case)",
            "a bank saved at another world size is refused",
        )
        checks = [
            Check(c.name, c.ok, "n/a: shard groups of one rank hold whole tensors") if c.name in vacuous else c
            for c in checks
        ]
    return checks


def load_results(outdir: str, world: int) -> list[dict[str, Any]]:
    found = []
    for rank in range(world):
        path = os.path.join(outdir, f"rank{rank}.pt")
        found.append(
            torch.load(path, weights_only=False)
            if os.path.exists(path)
            else {"rank": rank, "error": f"no result file {path} (the process died)"}
        )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun entry point: every rank runs the scenarios, rank 0 prints the checks."""
    ap = argparse.ArgumentParser(prog="python -m populora_verl.workers.shard_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/populora_shard_check", help="shared folder for per-rank results")
    ap.add_argument("--backend", default=None, help="nccl (default with CUDA) or gloo")
    args = ap.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.makedirs(args.out, exist_ok=True)
    run_rank(rank, world, args.out, backend=backend)
    if rank != 0:
        return 0
    checks = check_results(load_results(args.out, world))
    for c in checks:
        print(f"{'OK  ' if c.ok else 'FAIL'} {c.name}" + (f": {c.detail}" if c.detail else ""), flush=True)
    print(
        f"shard_check: world={world} backend={backend} {sum(c.ok for c in checks)}/{len(checks)} checks passed",
        flush=True,
    )
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
