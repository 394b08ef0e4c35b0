"""One weight-sync socket per trainer, also when several trainers share a host.

verl 0.9.1 sends LoRA weights from the trainer to its colocated vLLM engine over a ZMQ IPC socket named
``/tmp/rl-colocate-zmq-<ray job id>-replica-<r>-rank-<k>.sock`` on both sides (``ServerAdapter.zmq_handle`` in the
trainer's worker, ``_get_zmq_handle`` in the vLLM worker, which reads ``VERL_RAY_JOB_ID``). The Ray job id is not
unique on a host: every fresh local Ray cluster numbers its first job ``01000000``. Two independent trainers on one
node (one arm per GPU, each with its own Ray) therefore share the socket path, and a weight sync that overlaps
another trainer's can reach the wrong engine (four trainers on one 4-GPU node: two hung in ``zmq send`` right after
syncs that coincided). We add the Ray node id, which differs between clusters and is the same for a trainer worker
and the engine it is colocated with.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["JOB_ID_ENV", "unique_job_id", "rewrite_zmq_handle", "current_unique_job_id", "export_unique_job_id"]

#: What verl's vLLM worker reads to name its side of the socket.
JOB_ID_ENV = "VERL_RAY_JOB_ID"


def unique_job_id(job_id: str, node_id: str) -> str:
    """The job id plus 8 hex digits of the node id: short (a Unix socket path has ~107 bytes), distinct per cluster."""
    return f"{job_id}-{hashlib.sha1(node_id.encode()).hexdigest()[:8]}"


def rewrite_zmq_handle(handle: str, job_id: str, unique: str) -> str:
    """verl's ``ipc:///tmp/rl-colocate-zmq-<job_id>-replica-...`` with ``unique`` in place of the job id.

    Raises ValueError when the handle does not have the form this module was written against (a verl upgrade that
    renamed it): failing at start-up beats a sender and a receiver that silently disagree."""
    marker = f"rl-colocate-zmq-{job_id}-replica-"
    if marker not in handle:
        raise ValueError(
            f"unexpected verl weight-sync socket {handle!r} (expected one containing {marker!r}); "
            "populora_verl.rollout.weight_sync must follow verl's naming"
        )
    return handle.replace(marker, f"rl-colocate-zmq-{unique}-replica-", 1)


def current_unique_job_id() -> tuple[str, str]:
    """(Ray job id, its host-unique form) of the calling Ray process."""
    import ray

    ctx = ray.get_runtime_context()
    job_id = ctx.get_job_id()
    return job_id, unique_job_id(job_id, ctx.get_node_id())


def export_unique_job_id() -> str:
    """In the vLLM server actor, before its engine starts: the engine's workers name their socket from this."""
    _, unique = current_unique_job_id()
    os.environ[JOB_ID_ENV] = unique
    return unique
