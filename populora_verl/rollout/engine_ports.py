"""Port ranges of their own for vLLM engines that start together on one host.

A single-node vLLM engine picks the port of its workers' ``torch.distributed`` rendezvous by binding a throwaway
socket, reading the port the OS gave it and closing it; the workers bind that port seconds later. Engines that start
at the same moment on one host (every rollout replica of a trainer, and every trainer when several share a node) can
all be handed the same free port, and all but one fail with ``EADDRINUSE`` (verl-project/verl#6677; seen here with 4
replicas x TP 1 on one 4-GPU node). vLLM starts its search at ``VLLM_PORT`` when it is set and walks upward past ports
in use, so each engine gets a ``VLLM_PORT`` of its own: a block of :data:`PORT_STRIDE` ports per replica, the blocks of
one trainer side by side, starting at a place drawn from the Ray node id (which differs between Ray clusters, so two
trainers on one host land far apart unless the user chose the base).

A ``VLLM_PORT`` the user set stays the base: replica ``r`` searches from ``VLLM_PORT + r * PORT_STRIDE``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import MutableMapping

__all__ = ["PORT_STRIDE", "PORT_LOW", "PORT_HIGH", "VLLM_PORT_ENV", "engine_port_base", "export_engine_port"]

VLLM_PORT_ENV = "VLLM_PORT"
#: Ports per engine. vLLM walks upward from its base past ports in use; one engine binds a few, and a block this wide
#: leaves room for the walk without reaching the next replica's base.
PORT_STRIDE = 32
#: The range drawn from: above the usual service ports, below Linux's default ephemeral range (32768-60999 on most
#: hosts is where the OS hands out the throwaway ports; starting lower keeps clear of most of them).
PORT_LOW = 20000
PORT_HIGH = 32000


def engine_port_base(replica_rank: int, cluster_key: str, user_base: int | None = None) -> int:
    """The first port replica ``replica_rank``'s engine may use.

    ``cluster_key`` identifies the trainer's Ray cluster on this host (its node id): every replica of one trainer
    draws the same start, and consecutive replicas take consecutive blocks, so no two of them ever share a block.
    """
    if replica_rank < 0:
        raise ValueError(f"replica_rank must be >= 0, got {replica_rank}")
    if user_base is not None:
        base = user_base + replica_rank * PORT_STRIDE
        if user_base < 1024 or base + PORT_STRIDE > 65536:
            raise ValueError(
                f"{VLLM_PORT_ENV}={user_base} leaves no room for replica {replica_rank}'s {PORT_STRIDE} ports "
                f"(needs {VLLM_PORT_ENV} >= 1024 and {VLLM_PORT_ENV} + {(replica_rank + 1) * PORT_STRIDE} <= 65536)"
            )
        return base
    blocks = (PORT_HIGH - PORT_LOW) // PORT_STRIDE
    start = int(hashlib.sha1(cluster_key.encode()).hexdigest()[:8], 16) % blocks
    return PORT_LOW + ((start + replica_rank) % blocks) * PORT_STRIDE


def _parse_port(raw: str) -> int | None:
    if raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{VLLM_PORT_ENV} must be a port number, got {raw!r}") from None


def export_engine_port(replica_rank: int, cluster_key: str, env: MutableMapping[str, str] | None = None) -> int:
    """In a replica's vLLM server process, before its engine starts: sets ``VLLM_PORT`` to the replica's base
    (:func:`engine_port_base`) and returns it. Idempotent: the user's base is remembered under a second name, so a
    second call does not offset an already offset port."""
    env = os.environ if env is None else env
    user_key = f"POPULORA_USER_{VLLM_PORT_ENV}"
    if user_key not in env:
        env[user_key] = env.get(VLLM_PORT_ENV, "")
    base = engine_port_base(replica_rank, cluster_key, _parse_port(env[user_key]))
    env[VLLM_PORT_ENV] = str(base)
    return base
