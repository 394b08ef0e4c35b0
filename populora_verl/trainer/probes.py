"""Multi-GPU debug probes (``+trainer.populora_debug_probes=true``): per-rank bank checksums and per-replica greedy
probes. They print ``[populora]`` lines that ``scripts/gpu/multi_gpu_proof.sh`` greps; they never stop a run.

* :func:`rank_report`: which slots changed **on each rank** during a step (each rank hashes its own shards, no
  collective), against the slots that trained. One rank keeping a stale shard shows up here even when the gathered
  full adapter looks right.
* :func:`probe_replicas`: the same greedy prompt sent straight to **every vLLM replica** under every member's LoRA
  id. Each replica must hold every id of the current table (so evolution's new ids reached all replicas) and answer
  under each; the line also counts distinct log-probs per replica (adapters differ once trained) and the adapters
  whose greedy tokens agree across replicas.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["rank_changes", "rank_report", "replica_report", "probe_replicas", "prompt_ids"]


def rank_changes(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> dict[int, list[int]]:
    """``rank -> sorted slots whose shard hash changed`` from two ``populora_shard_checksums`` results (all ranks)."""
    b = {int(x["rank"]): x["slots"] for x in before if x}
    out = {}
    for x in after:
        if not x:
            continue
        rank, slots = int(x["rank"]), x["slots"]
        prev = b.get(rank, {})
        out[rank] = sorted(int(k) for k in slots if prev.get(k) != slots[k])
    return dict(sorted(out.items()))


def rank_report(step: int, before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]],
                trained: Sequence[int]) -> tuple[str, bool]:
    """One line: per rank, the changed slots; OK only if every rank changed exactly the trained slots."""
    changes = rank_changes(before, after)
    want = sorted(int(s) for s in trained)
    ok = bool(changes) and all(c == want for c in changes.values())
    per = " ".join(f"rank{r}:{c}" for r, c in changes.items())
    return f"[populora] step {step} rank checksums: {per} | trained={want} {'OK' if ok else 'MISMATCH'}", ok


def replica_report(step: int, results: Sequence[Mapping[str, Any]], table: Mapping[str, Mapping[str, Any]]
                   ) -> tuple[list[str], bool]:
    """Lines for a per-replica probe and whether every replica holds and answers under every id of ``table``.

    ``results[i] = {"loaded": [ids], "outputs": {member: {"token_ids": [...], "sum_logp": float}}}`` (or
    ``{"error": str}``). Distinct log-probs are reported, not required: before the first update every adapter is
    the base model.
    """
    want = {int(v["lora_int_id"]) for v in table.values()}
    lines, ok = [], bool(results)
    tokens_by_member: dict[str, set[tuple[int, ...]]] = {}
    for i, r in enumerate(results):
        if "error" in r:
            lines.append(f"[populora] step {step} replica {i}: probe failed: {r['error']}")
            ok = False
            continue
        missing = sorted(want - {int(x) for x in r.get("loaded", [])})
        outs = r.get("outputs", {})
        distinct = len({round(float(o["sum_logp"]), 4) for o in outs.values()})
        for m, o in outs.items():
            tokens_by_member.setdefault(m, set()).add(tuple(o["token_ids"]))
        ok &= not missing and len(outs) == len(table)
        lines.append(f"[populora] step {step} replica {i}: {len(want) - len(missing)}/{len(want)} LoRA ids loaded"
                     + (f" (missing {missing})" if missing else "") + f", {distinct}/{len(outs)} distinct greedy log-probs")
    # Reported, not required: replicas batch the concurrent probe requests their own way, and a near-tie can flip
    # a greedy token between two correct replicas.
    agree = sum(len(v) == 1 for v in tokens_by_member.values())
    lines.insert(0, f"[populora] step {step} replica probe: {len(results)} replica(s), every LoRA id on every replica "
                    f"{'OK' if ok else 'MISMATCH'}; same greedy tokens on every replica for {agree}/"
                    f"{len(tokens_by_member)} adapters")
    return lines, ok


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a chat turn (plain text if the tokenizer has no chat template)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # no chat template: the base prompt itself
        text = prompt
    return list(tokenizer.encode(text, add_special_tokens=False))


def probe_replicas(replicas: Sequence[Any], ids: Sequence[int], table: Mapping[str, Mapping[str, Any]],
                   max_tokens: int = 16) -> list[dict[str, Any]]:
    """Greedy ``ids`` on every replica's server under every member's LoRA id (replicas must be awake)."""
    import ray

    results = []
    for rep in replicas:
        try:
            server = rep.server_handle
            loaded = ray.get(server.populora_live_loras.remote()).get("loaded", [])
            refs = {m: server.generate.remote(list(ids), {"temperature": 0.0, "top_p": 1.0, "max_tokens": max_tokens,
                                                          "logprobs": True},
                                              f"populora-probe-{uuid.uuid4().hex}",
                                              populora_lora={"lora_int_id": int(t["lora_int_id"]),
                                                             "lora_name": str(t["lora_name"])})
                    for m, t in table.items()}
            outs = {}
            for m, ref in refs.items():
                o = ray.get(ref)
                outs[m] = {"token_ids": list(o.token_ids), "sum_logp": float(sum(o.log_probs or []))}
            results.append({"loaded": list(loaded), "outputs": outs})
        except Exception as e:  # diagnostics: report, never fail the run
            results.append({"error": f"{type(e).__name__}: {str(e)[:200]}"})
    return results


def print_replica_probe(replicas: Sequence[Any], tokenizer: Any, prompt: str,
                        table: Mapping[str, Mapping[str, Any]], step: int) -> bool:
    try:
        lines, ok = replica_report(step, probe_replicas(replicas, prompt_ids(tokenizer, prompt), table), table)
    except Exception as e:
        logger.warning("populora replica probe failed: %s", e)
        return False
    for line in lines:
        print(line, flush=True)
    return ok
