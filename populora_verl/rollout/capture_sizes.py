"""CUDA-graph capture sizes limited to the batch sizes a recipe's rollout can reach.

vLLM captures a CUDA graph per size in ``cudagraph_capture_sizes`` (per LoRA case as well) during start-up, and pads a
decode batch to the next captured size. A replica never runs more sequences at once than the largest phase of a step
sends it (every request of a phase is submitted at once) or ``rollout.max_num_seqs``; sizes above that are captured
for nothing. :func:`reachable_capture_sizes` keeps the sizes below that bound and the first size at or above it.

A start-up lever to measure (``python -m populora_verl.bench.startup --lever capture_sizes``): the recipes keep
their sizes until a GPU A/B shows the saving.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from populora_verl.config import PopuLoRAConfig, load_config

__all__ = [
    "CAPTURE_KEY",
    "PhaseSizes",
    "phase_sequences",
    "max_concurrent_sequences",
    "vllm_default_capture_sizes",
    "reachable_capture_sizes",
    "capture_sizes_override",
]

CAPTURE_KEY = "actor_rollout_ref.rollout.cudagraph_capture_sizes"
#: verl's default ``rollout.max_num_seqs`` (its rollout.yaml).
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class PhaseSizes:
    """Sequences one step (and the seeding phase before step 1) sends to vLLM at once, over all replicas."""

    seed: int
    teacher: int
    student: int

    @property
    def largest(self) -> int:
        return max(self.seed, self.teacher, self.student)


def phase_sequences(cfg: PopuLoRAConfig) -> PhaseSizes:
    """Sequences per generation phase of ``cfg`` when every proposal is valid (a student's invalid proposal gets a
    buffer task with as many answers, so the count does not depend on validity): the teachers' proposals, the
    students' answers (estimation answers plus ``max_new`` buffer tasks), and the first seeding round (one proposal
    per missing program: ``seed_programs`` for the io types, as many again for ``code_f``)."""
    r, types = cfg.rollout, list(cfg.tasks.types)
    proposals = r.teacher_n * r.proposals_per_type * len(types)
    per_task = r.student_n + ((r.buffer_task_n or r.student_n) if cfg.buffer.student_mix == "max_new" else 0)
    if cfg.population.mode == "single_agent":
        teachers, answered = 1, proposals
    else:
        p = cfg.population
        teachers = p.num_teachers
        answered = p.num_students * p.num_teachers * min(cfg.matchmaking.students_per_problem, p.num_students)
        answered = answered * proposals // p.num_students
    io = any(t in types for t in ("code_i", "code_o"))
    seed = cfg.buffer.seed_programs * (int(io) + int("code_f" in types))
    return PhaseSizes(seed=seed, teacher=teachers * proposals, student=answered * per_task)


def _replicas(config: DictConfig) -> int:
    sel = lambda key, default: OmegaConf.select(config, key, default=default)  # noqa: E731
    gpus = int(sel("trainer.n_gpus_per_node", 1)) * int(sel("trainer.nnodes", 1))
    per_replica = 1
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        per_replica *= int(sel(f"actor_rollout_ref.rollout.{key}", 1) or 1)
    return max(1, gpus // per_replica)


def max_concurrent_sequences(config: DictConfig) -> int:
    """The most sequences one vLLM replica can hold at once in a run of ``config`` (a composed verl config with a
    ``populora`` section): the largest phase split over the replicas, capped by ``rollout.max_num_seqs``."""
    cfg = load_config(config.get("populora"))
    largest = phase_sequences(cfg).largest
    max_num_seqs = int(OmegaConf.select(config, "actor_rollout_ref.rollout.max_num_seqs", default=None) or 0)
    per_replica = math.ceil(largest / _replicas(config))
    return max(1, min(per_replica, max_num_seqs or DEFAULT_MAX_NUM_SEQS))


def vllm_default_capture_sizes(max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> list[int]:
    """vLLM's own ladder when none is given: 1, 2, 4, then steps of 8 to 256 and of 16 beyond, up to
    ``min(2 * max_num_seqs, 512)``."""
    top = min(2 * max_num_seqs, 512)
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return [s for s in ladder if s <= top]


def reachable_capture_sizes(config: DictConfig, sizes: Sequence[int] | None = None) -> list[int]:
    """``sizes`` (default: the config's ``cudagraph_capture_sizes``, else vLLM's ladder) limited to what a replica
    can reach: every size below :func:`max_concurrent_sequences` and the first at or above it."""
    if sizes is None:
        sizes = OmegaConf.select(config, CAPTURE_KEY, default=None)
    if not sizes:
        max_num_seqs = OmegaConf.select(config, "actor_rollout_ref.rollout.max_num_seqs", default=None)
        sizes = vllm_default_capture_sizes(int(max_num_seqs or DEFAULT_MAX_NUM_SEQS))
    ladder = sorted({int(s) for s in sizes})
    if not ladder or ladder[0] < 1:
        raise ValueError(f"{CAPTURE_KEY}: sizes must be positive integers, got {list(sizes)}")
    cap = max_concurrent_sequences(config)
    kept = [s for s in ladder if s < cap]
    above = [s for s in ladder if s >= cap]
    return kept + above[:1]


def capture_sizes_override(config: DictConfig) -> str | None:
    """The Hydra override that limits the capture sizes to the reachable ones, or None when the config's sizes are
    all reachable already or vLLM runs eager (``rollout.enforce_eager``: no graphs)."""
    if OmegaConf.select(config, "actor_rollout_ref.rollout.enforce_eager", default=False):
        return None
    current = OmegaConf.select(config, CAPTURE_KEY, default=None)
    reach = reachable_capture_sizes(config)
    if current and sorted(int(s) for s in current) == reach:
        return None
    return f"{CAPTURE_KEY}=[{','.join(map(str, reach))}]"


def describe(config: DictConfig) -> Mapping[str, Any]:
    """The numbers behind :func:`reachable_capture_sizes` (for a report line)."""
    cfg = load_config(config.get("populora"))
    return {
        "phases": phase_sequences(cfg),
        "replicas": _replicas(config),
        "max_concurrent": max_concurrent_sequences(config),
        "sizes": reachable_capture_sizes(config),
    }
