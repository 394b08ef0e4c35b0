"""Every vLLM engine of a trainer searches its ports from a block of its own (rollout.engine_ports)."""

from __future__ import annotations

import pytest

from populora_verl.rollout.engine_ports import (
    PORT_HIGH,
    PORT_LOW,
    PORT_STRIDE,
    VLLM_PORT_ENV,
    engine_port_base,
    export_engine_port,
)


@pytest.mark.parametrize("key", ["a" * 56, "0123abcd" * 7, "node-x", ""])
def test_replicas_of_one_trainer_get_disjoint_blocks(key):
    # 64 replicas (8 nodes of 8 GPUs at TP 1): no two blocks overlap, all inside the range, and the block a replica
    # searches from leaves the whole stride before the next replica's base
    bases = [engine_port_base(r, key) for r in range(64)]
    assert len(set(bases)) == 64
    assert all(PORT_LOW <= b and b + PORT_STRIDE <= PORT_HIGH for b in bases)
    ordered = sorted(bases)
    assert all(nxt - cur >= PORT_STRIDE for cur, nxt in zip(ordered, ordered[1:]))


def test_the_base_is_a_function_of_the_cluster_and_replica_only():
    assert engine_port_base(3, "node-1") == engine_port_base(3, "node-1")
    # trainers on one host have different Ray node ids: their replica 0s search from different places
    starts = {engine_port_base(0, f"{i:056x}") for i in range(50)}
    assert len(starts) > 40


def test_a_user_base_is_kept_and_offset_per_replica():
    assert engine_port_base(0, "k", 40000) == 40000
    assert engine_port_base(2, "k", 40000) == 40000 + 2 * PORT_STRIDE
    with pytest.raises(ValueError, match=VLLM_PORT_ENV):
        engine_port_base(1, "k", 65530)
    with pytest.raises(ValueError, match=VLLM_PORT_ENV):
        engine_port_base(0, "k", 80)
    with pytest.raises(ValueError, match="replica_rank"):
        engine_port_base(-1, "k")


def test_export_sets_the_variable_once_per_process():
    env: dict[str, str] = {}
    base = export_engine_port(1, "node-1", env)
    assert env[VLLM_PORT_ENV] == str(base) == str(engine_port_base(1, "node-1"))
    # a second call (a server re-initialised in the same process) does not treat the exported port as the user's
    assert export_engine_port(1, "node-1", env) == base

    user = {VLLM_PORT_ENV: "41000"}
    assert export_engine_port(2, "node-1", user) == 41000 + 2 * PORT_STRIDE
    assert export_engine_port(2, "node-1", user) == 41000 + 2 * PORT_STRIDE
    assert user[VLLM_PORT_ENV] == str(41000 + 2 * PORT_STRIDE)


def test_a_port_that_is_not_a_number_fails_naming_the_variable():
    with pytest.raises(ValueError, match="VLLM_PORT must be a port number"):
        export_engine_port(0, "k", {VLLM_PORT_ENV: "tcp://10.0.0.1:5000"})
