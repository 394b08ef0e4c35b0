"""0005: the weight-sync socket path is unique per host, not only per Ray job (the plugin's rollout.weight_sync and
rollout.server_adapter work around it)."""

from __future__ import annotations

PATCH = "0005-weight-sync-socket-unique-per-host.patch"

# Two trainers, each with its own local Ray cluster on one host: both clusters number their first job 01000000 and
# differ by node id. Each side of the socket is computed the way verl computes it: the trainer's ServerAdapter from its
# own runtime context, the vLLM worker (_get_zmq_handle's format) from VERL_RAY_JOB_ID as the server exported it.
CHECK = """
import ast, os, types
from pathlib import Path
import ray
import verl.workers.rollout.utils as rutils

def context(job, node):
    return types.SimpleNamespace(get_job_id=lambda: job, get_node_id=lambda: node)

root = Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout"

def sender_handle(replica, rank):
    # ServerAdapter.__init__'s two lines that name the socket, run as they are written in this verl
    tree = ast.parse((root / "vllm_rollout.py").read_text())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "ServerAdapter"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    lines = [s for s in init.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) in ("job_id", "self.zmq_handle")]
    ns = {"self": types.SimpleNamespace(replica_rank=replica), "local_rank": rank, "ray": ray}
    ns.update({k: getattr(rutils, k) for k in dir(rutils) if k.startswith("get_")})
    exec(compile(ast.Module(body=lines, type_ignores=[]), "sender", "exec"), ns)
    return ns["self"].zmq_handle

def server_exported_job_id():
    # vLLMHttpServer.__init__'s export of VERL_RAY_JOB_ID, as written in this verl
    tree = ast.parse((root / "vllm_async_server.py").read_text())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "vLLMHttpServer"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    stmt = next(s for s in init.body if isinstance(s, ast.Assign) and "VERL_RAY_JOB_ID" in ast.unparse(s.targets[0]))
    ns = {"os": os, "ray": ray, **{k: getattr(rutils, k) for k in dir(rutils) if k.startswith("get_")}}
    exec(compile(ast.Module(body=[stmt], type_ignores=[]), "server", "exec"), ns)
    return os.environ["VERL_RAY_JOB_ID"]

def receiver_handle(replica, rank):
    return f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-{replica}-rank-{rank}.sock"

handles = {}
for cluster, node in (("A", "a" * 56), ("B", "b" * 56)):
    ray.get_runtime_context = lambda node=node: context("01000000", node)
    send = sender_handle(0, 0)
    server_exported_job_id()
    assert receiver_handle(0, 0) == send, (send, receiver_handle(0, 0))  # both ends of one trainer agree
    handles[cluster] = send
print(handles)
assert handles["A"] != handles["B"], f"two trainers on one host share the weight-sync socket {handles['A']}"
"""


def test_two_clusters_on_one_host_get_different_sockets(fails_without_passes_with):
    out = fails_without_passes_with(PATCH, CHECK, expect_without="share the weight-sync socket")
    assert "01000000-" in out
