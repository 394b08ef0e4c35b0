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

import json
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


def rank_report(
    step: int, before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]], trained: Sequence[int]
) -> tuple[str, bool]:
    """One line: per rank, the changed slots; OK only if every rank changed exactly the trained slots."""
    changes = rank_changes(before, after)
    want = sorted(int(s) for s in trained)
    ok = bool(changes) and all(c == want for c in changes.values())
    per = " ".join(f"rank{r}:{c}" for r, c in changes.items())
    return f"[populora] step {step} rank checksums: {per} | trained={want} {'OK' if ok else 'MISMATCH'}", ok


def replica_report(
    step: int, results: Sequence[Mapping[str, Any]], table: Mapping[str, Mapping[str, Any]]
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
        lines.append(
            f"[populora] step {step} replica {i}: {len(want) - len(missing)}/{len(want)} LoRA ids loaded"
            + (f" (missing {missing})" if missing else "")
            + f", {distinct}/{len(outs)} distinct greedy log-probs"
        )
    # Reported, not required: replicas batch the concurrent probe requests their own way, and a near-tie can flip
    # a greedy token between two correct replicas.
    agree = sum(len(v) == 1 for v in tokens_by_member.values())
    lines.insert(
        0,
        f"[populora] step {step} replica probe: {len(results)} replica(s), every LoRA id on every replica "
        f"{'OK' if ok else 'MISMATCH'}; same greedy tokens on every replica for {agree}/"
        f"{len(tokens_by_member)} adapters",
    )
    return lines, ok


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a chat turn (plain text if the tokenizer has no chat template)."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # no chat template: the base prompt itself
        text = prompt
    return list(tokenizer.encode(text, add_special_tokens=False))


def probe_replicas(
    replicas: Sequence[Any], ids: Sequence[int], table: Mapping[str, Mapping[str, Any]], max_tokens: int = 16
) -> list[dict[str, Any]]:
    """Greedy ``ids`` on every replica's server under every member's LoRA id (replicas must be awake)."""
    import ray

    results = []
    for rep in replicas:
        try:
            server = rep.server_handle
            loaded = ray.get(server.populora_live_loras.remote()).get("loaded", [])
            refs = {
                m: server.generate.remote(
                    list(ids),
                    {"temperature": 0.0, "top_p": 1.0, "max_tokens": max_tokens, "logprobs": True},
                    f"populora-probe-{uuid.uuid4().hex}",
                    populora_lora={"lora_int_id": int(t["lora_int_id"]), "lora_name": str(t["lora_name"])},
                )
                for m, t in table.items()
            }
            outs = {}
            for m, ref in refs.items():
                o = ray.get(ref)
                outs[m] = {"token_ids": list(o.token_ids), "sum_logp": float(sum(o.log_probs or []))}
            results.append({"loaded": list(loaded), "outputs": outs})
        except Exception as e:  # diagnostics: report, never fail the run
            results.append({"error": f"{type(e).__name__}: {str(e)[:200]}"})
    return results


def print_replica_probe(
    replicas: Sequence[Any], tokenizer: Any, prompt: str, table: Mapping[str, Mapping[str, Any]], step: int
) -> bool:
    try:
        lines, ok = replica_report(step, probe_replicas(replicas, prompt_ids(tokenizer, prompt), table), table)
    except Exception as e:
        logger.warning("populora replica probe failed: %s", e)
        return False
    for line in lines:
        print(line, flush=True)
    return ok


#: The greedy probe's prompt, answered under every LoRA id at each step (``+trainer.populora_debug_probes=true``).
PROBE_PROMPT = "Write a Python function `f(x)` that returns the sum of the digits of the integer x. Answer briefly."


class ProbesMixin:
    """The debug probes of ``+trainer.populora_debug_probes=true``: bank checksums per step and a greedy probe under
    every LoRA id. Mixed into :class:`~populora_verl.trainer.trainer.PopuLoRATrainer`."""

    def _debug_checksums(self) -> dict[int, str]:
        from populora_verl.trainer import convert

        self._rank_sums = self.actor_rollout_wg.populora_shard_checksums()  # each rank's own shards, same moment
        return {
            int(m.slot): convert.state_checksum(self._get_adapter(int(m.slot)))
            for m in self.pop_step.population.members
        }

    def _log_adapter_report(
        self,
        step: int,
        per_adapter: Mapping[str, Mapping[str, Any]],
        parts: Mapping[int, list[str]],
        member_of: Mapping[int, str],
        before: Mapping[int, str] | None,
    ) -> None:
        for member, m in per_adapter.items():
            diff = {k.split("/")[-1]: v for k, v in m.items() if "rollout_probs_diff" in k or "probs_pearson" in k}
            # Under bypass_mode only the periodic check compares two engines; other steps have nothing to show.
            shown = json.dumps(diff, default=float) if diff else "n/a"
            print(
                f"[populora] step {step} {member}: samples={m.get('populora/samples')} "
                f"pg_loss={m.get('actor/pg_loss')} rollout_vs_trainer={shown}",
                flush=True,
            )
        if before is None:
            return
        rank_before = self._rank_sums
        after = self._debug_checksums()
        changed = sorted(s for s in after if after[s] != before.get(s))
        trained = sorted(parts)
        print(rank_report(step, rank_before, self._rank_sums, trained)[0], flush=True)
        ok = changed == trained
        print(
            f"[populora] step {step} bank checksums: "
            + " ".join(f"{member_of.get(s, s)}@{s}:{before.get(s)}->{after[s]}" for s in sorted(after))
            + f" | changed={changed} trained={trained} {'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
        if not ok:
            logger.error("populora: slots changed %s but trained %s", changed, trained)

    def _probe_adapters(self) -> None:
        """Greedy answer to one fixed prompt under every member's LoRA id (replicas are awake between steps)."""
        import transfer_queue as tq

        from populora_verl.step import GenRequest
        from populora_verl.trainer import convert
        from populora_verl.trainer.convert import PARTITION

        members = self.pop_step.population.members
        reqs = [GenRequest(m.id, "teacher", "code_i", PROBE_PROMPT, 1, {}) for m in members]
        table = self._lora_table()
        rows = convert.requests_to_rows(reqs, table, self.global_steps, start_index=self._next_index)
        self._next_index += len(rows)
        for r in rows:
            r["__do_sample__"] = False
        self._submit_rows(rows)
        batch, _ = self.replay_buffer.sample(
            global_steps=self.global_steps, partition_id=PARTITION, batch_size=len(rows)
        )
        texts, _, _ = self._fetch_responses(batch.keys)
        by_uid = convert.group_trajectory_keys(batch.keys)
        outs = {}
        for m, r in zip(members, rows, strict=True):
            key = by_uid.get(r["uid"], {}).get(0)
            outs[m.id] = texts.get(key, "<no output>") if key else "<no output>"
        # Greedy text only changes once adapters have moved far; vLLM's own log-probs of the greedy tokens show
        # which LoRA each request really ran with, from the first small update on.
        logps: dict[str, float] = {}
        try:
            lp = tq.kv_batch_get(keys=list(batch.keys), partition_id=PARTITION, select_fields=["rollout_log_probs"])
            per_key = {k: float(t.float().sum()) for k, t in zip(batch.keys, lp["rollout_log_probs"].unbind())}
            for m, r in zip(members, rows, strict=True):
                key = by_uid.get(r["uid"], {}).get(0)
                if key in per_key:
                    logps[m.id] = per_key[key]
        except Exception as e:  # the probe is diagnostics: never fail the run over it
            logger.warning("populora probe: no rollout log-probs (%s)", e)
        tq.kv_clear(keys=list(batch.keys), partition_id=PARTITION)
        distinct = len(set(outs.values()))
        distinct_lp = len({round(v, 4) for v in logps.values()})
        print(
            f"[populora] step {self.global_steps} greedy probe: {distinct}/{len(outs)} distinct outputs, "
            f"{distinct_lp}/{len(logps)} distinct greedy log-probs",
            flush=True,
        )
        for mid, text in outs.items():
            print(
                f"[populora]   {mid} lora_int_id={table[mid]['lora_int_id']} ({table[mid]['lora_name']}): "
                f"sum_logp={logps.get(mid, float('nan')):.6f} {text[:100]!r}",
                flush=True,
            )
        print_replica_probe(
            self.llm_server_manager.get_replicas(), self.tokenizer, PROBE_PROMPT, table, self.global_steps
        )
