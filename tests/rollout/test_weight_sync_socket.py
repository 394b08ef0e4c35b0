"""Trainers with their own Ray clusters on one host must not share verl's weight-sync socket.

Every fresh local Ray cluster names its first job ``01000000``, and verl names the trainer-to-vLLM ZMQ socket after
the job id only: four one-GPU trainers on one 4-GPU node all used ``/tmp/rl-colocate-zmq-01000000-replica-0-rank-0
.sock``, and two of them hung in ``zmq send`` during a weight sync. These tests pin our fix and verl's naming."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

from populora_verl import verl_compat
from populora_verl.rollout.weight_sync import JOB_ID_ENV, rewrite_zmq_handle, unique_job_id

VERL_HANDLE = "ipc:///tmp/rl-colocate-zmq-{job}-replica-{replica}-rank-{rank}.sock"


def test_two_clusters_on_one_host_get_two_sockets_and_each_side_agrees():
    job = "01000000"  # what every fresh local Ray cluster calls its first job
    a, b = unique_job_id(job, "node-of-cluster-a"), unique_job_id(job, "node-of-cluster-b")
    assert a != b and a.startswith(job) and unique_job_id(job, "node-of-cluster-a") == a
    sender = rewrite_zmq_handle(VERL_HANDLE.format(job=job, replica=0, rank=0), job, a)
    # the receiver (verl's vLLM worker) formats the same template with the job id we export to it
    receiver = VERL_HANDLE.format(job=a, replica=0, rank=0)
    assert sender == receiver != rewrite_zmq_handle(VERL_HANDLE.format(job=job, replica=0, rank=0), job, b)
    assert len(sender) - len("ipc://") < 100  # a Unix socket path has about 107 bytes
    with pytest.raises(ValueError, match="must follow verl's naming"):
        rewrite_zmq_handle("ipc:///tmp/some-other-socket.sock", job, a)


# A verl with get_weight_sync_job_id (patches/0005) names the socket uniquely itself: the plugin registers verl's own
# adapter and leaves the server's environment alone (tests/patches/test_weight_sync_socket.py tests verl's fix).
VERL_FIXED = pytest.mark.skipif(verl_compat.has_weight_sync_job_id(), reason="verl names the socket per host itself")


@VERL_FIXED
def test_verl_still_names_both_ends_as_this_fix_assumes():
    verl = pytest.importorskip("verl")
    root = Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout"
    sender = (root / "vllm_rollout.py").read_text()
    receiver = (root / "utils.py").read_text()
    server = (root / "vllm_async_server.py").read_text()
    assert 'f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-{self.replica_rank}-rank-{local_rank}.sock"' in sender
    assert 'job_id = os.environ.get("VERL_RAY_JOB_ID", "0")' in receiver
    assert 'f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-{replica_rank}-rank-{trainer_rank}.sock"' in receiver
    assert 'os.environ["VERL_RAY_JOB_ID"] = ray.get_runtime_context().get_job_id()' in server


@VERL_FIXED
def test_the_registered_adapter_rewrites_verls_handle(monkeypatch):
    """With a stand-in for verl's vLLM module (vLLM is not installed on CPU): the adapter verl builds by name sends
    to the host-unique socket, and the server side exports the same id for its engine workers."""
    import ray

    class FakeServerAdapter:
        def __init__(self, *a, **kw):
            job_id = ray.get_runtime_context().get_job_id()
            self.zmq_handle = VERL_HANDLE.format(job=job_id, replica=1, rank=0)

    fake = types.ModuleType("verl.workers.rollout.vllm_rollout.vllm_rollout")
    fake.ServerAdapter = FakeServerAdapter
    pkg = types.ModuleType("verl.workers.rollout.vllm_rollout")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout", pkg)
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout.vllm_rollout", fake)
    ctx = types.SimpleNamespace(get_job_id=lambda: "01000000", get_node_id=lambda: "abc123")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
    monkeypatch.delitem(sys.modules, "populora_verl.rollout.server_adapter", raising=False)
    from populora_verl.rollout import SERVER_ADAPTER_FQN

    mod_name, cls_name = SERVER_ADAPTER_FQN.rsplit(".", 1)
    adapter = getattr(importlib.import_module(mod_name), cls_name)()
    unique = unique_job_id("01000000", "abc123")
    assert adapter.zmq_handle == VERL_HANDLE.format(job=unique, replica=1, rank=0)
    from populora_verl.rollout.weight_sync import export_unique_job_id

    monkeypatch.setenv(JOB_ID_ENV, "01000000")  # what verl's server exported; restored after the test
    assert export_unique_job_id() == unique
    import os

    assert os.environ[JOB_ID_ENV] == unique


@pytest.mark.skipif(not verl_compat.has_weight_sync_job_id(), reason="verl 0.9.1: the plugin's adapter fixes it")
def test_with_verls_fix_the_backend_uses_verls_adapter():
    from populora_verl.rollout import VERL_SERVER_ADAPTER_FQN, server_adapter_fqn

    assert server_adapter_fqn() == VERL_SERVER_ADAPTER_FQN
