"""Generation through TransferQueue: a phase's prompts as TQ rows, verl's agent loop, the responses back as
:class:`~populora_verl.step.GenResponse` (the trainer's side of ``begin`` / ``on_proposals`` / seeding)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transfer_queue as tq
from transfer_queue import KVBatchMeta

from populora_verl import verl_compat
from populora_verl.trainer import convert
from populora_verl.trainer.convert import PARTITION, field_rows

logger = logging.getLogger(__name__)


@dataclass
class _Phase:
    """The prompt groups of one generation phase (teachers or students) while they are in flight."""

    name: str
    requests: list[Any]
    uids: list[str]  # uid currently standing for request i (a refill gives a failed group a fresh uid)
    rows: list[dict[str, Any]]
    resubmitted: int = 0


def rollout_counts(tags: Sequence[Mapping[str, Any]], lengths: Mapping[str, int]) -> dict[str, float]:
    """Work of one rollout phase: sequences, prompt tokens (verl's per-trajectory ``prompt_len`` tag) and generated
    tokens (masked response lengths), for throughput figures (``populora_verl.bench.step_scaling``)."""
    prompt = 0
    for tag in tags:
        try:
            prompt += int((tag or {}).get("prompt_len") or 0)
        except (TypeError, ValueError):
            continue
    return {
        "sequences": float(len(lengths)),
        "prompt_tokens": float(prompt),
        "response_tokens": float(sum(lengths.values())),
    }


class GenerationMixin:
    """Generation of one phase (teachers, students or seeding) through TransferQueue and verl's agent loop.
    Mixed into :class:`~populora_verl.trainer.trainer.PopuLoRATrainer`."""

    def _submit_rows(self, rows: list[dict[str, Any]]) -> None:
        batch = convert.rows_to_tensordict(rows, self.global_steps)
        if verl_compat.has_public_prompt_submission():
            self.submit_batch_to_rollout(batch)
            return
        verl_compat.private_path("_submit_batch_to_rollout")
        self._submit_batch_to_rollout(batch)

    def add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's refill hook (failed or filtered groups): resubmit the current phase's evicted groups under fresh
        uids instead of reading a dataloader, so every request still gets its answers. verl 0.9.1 calls it by its
        private name, which the trainer forwards here."""
        phase = self._phase
        if phase is None:
            raise RuntimeError("PopuLoRA has no dataset: prompts are only generated inside a population step")
        listed = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
        alive = {k.split("_")[0] for k in listed}
        gone = [i for i, u in enumerate(phase.uids) if u not in alive][: int(num_prompts)]
        rows = []
        for i in gone:
            row = dict(phase.rows[i])
            row["uid"] = convert.new_uid()
            phase.uids[i] = row["uid"]
            phase.rows[i] = row
            rows.append(row)
        if rows:
            phase.resubmitted += len(rows)
            self._submit_rows(rows)
        return len(rows)

    def _fetch_responses(self, keys: Sequence[str]) -> tuple[dict[str, str], dict[str, int], dict[str, torch.Tensor]]:
        if not keys:
            return {}, {}, {}
        data = tq.kv_batch_get(keys=list(keys), partition_id=PARTITION, select_fields=["responses", "response_mask"])
        texts, lengths, masks = {}, {}, {}
        for k, ids, mask in zip(keys, field_rows(data["responses"]), field_rows(data["response_mask"]), strict=True):
            texts[k] = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            lengths[k] = int(mask.sum())
            masks[k] = mask
        return texts, lengths, masks

    def _generate(self, requests: list[Any], name: str, metrics: dict) -> tuple[list[Any], KVBatchMeta, dict]:
        """Submit one phase's requests, wait for all groups, decode. Returns (GenResponses, batch meta, masks)."""
        if not requests:
            return [], KVBatchMeta(partition_id=PARTITION), {}
        lora_of = self._lora_table()
        if name == "seed":  # the seeding phase's base-policy requests (PopulationStep.seed_begin)
            lora_of = convert.with_base_policy(lora_of, self.pop_step.population.members[0].id)
        rows = convert.requests_to_rows(requests, lora_of, self.global_steps, start_index=self._next_index)
        self._next_index += len(rows)
        self._phase = _Phase(name, list(requests), [r["uid"] for r in rows], rows)
        # Where a phase's time goes (the first step's generation has taken 4-5x a later one's): handing the prompts
        # to the agent loop, waiting for every trajectory, reading the responses back.
        t0 = time.perf_counter()
        try:
            self._submit_rows(rows)
            t1 = time.perf_counter()
            batch, sample_metrics = self.replay_buffer.sample(
                global_steps=self.global_steps, partition_id=PARTITION, batch_size=len(rows)
            )
            t2 = time.perf_counter()
            texts, lengths, masks = self._fetch_responses(batch.keys)
            t3 = time.perf_counter()
            responses, missing = convert.build_gen_responses(requests, self._phase.uids, batch.keys, texts, lengths)
        finally:
            phase, self._phase = self._phase, None
        metrics.update(convert.prefix_metrics(sample_metrics, f"populora/rollout/{name}"))
        metrics[f"populora/rollout/{name}/prompts"] = len(rows)
        metrics[f"populora/rollout/{name}/missing_sessions"] = missing
        metrics[f"populora/rollout/{name}/resubmitted"] = phase.resubmitted
        for what, sec in (("submit_s", t1 - t0), ("wait_s", t2 - t1), ("fetch_s", t3 - t2)):
            metrics[f"populora/rollout/{name}/{what}"] = sec
        metrics.update(convert.prefix_metrics(rollout_counts(batch.tags, lengths), f"populora/rollout/{name}"))
        if missing:
            logger.warning(
                "populora step %d: %d %s sessions produced no trajectory (scored as empty answers)",
                self.global_steps,
                missing,
                name,
            )
        return responses, batch, masks
