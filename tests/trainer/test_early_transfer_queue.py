"""TransferQueue started by the launching process while the task runner starts
(``trainer.populora_early_transfer_queue``): the section it starts with, a real start on a local Ray cluster that
a task-runner actor attaches to and moves data through, and a failed start that ends its controller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
from omegaconf import OmegaConf

from populora_verl.trainer import early_transfer_queue as etq

pytest.importorskip("transfer_queue")
ray = pytest.importorskip("ray")

# Only a hang ends the child's wait (a local Ray cluster and three TransferQueue processes start in well under a
# minute on an idle 2-core machine)
CHILD_TIMEOUT_S = 900


def _config(on=True, backend="SimpleStorage"):
    return OmegaConf.create({
        "trainer": {"populora_early_transfer_queue": on},
        "units": 1,
        "transfer_queue": {"enable": False, "backend": {"storage_backend": backend,
                                                        "SimpleStorage": {"num_data_storage_units": "${units}"}}},
    })


def test_the_section_is_the_task_runners_resolved_with_enable_set():
    assert etq.tq_conf(_config()) == {"enable": True, "backend": {"storage_backend": "SimpleStorage",
                                                                   "SimpleStorage": {"num_data_storage_units": 1}}}
    assert etq.tq_conf(_config(on=False)) is None
    assert etq.start(_config(on=False)) is None  # no thread


def test_another_backend_keeps_verls_order_and_says_so(capsys):
    assert etq.tq_conf(_config(backend="MooncakeStore")) is None
    line, = capsys.readouterr().out.strip().splitlines()
    assert etq.ENABLE_KEY in line and "MooncakeStore" in line and "verl's order" in line


def test_a_job_that_ends_before_ray_starts_ends_the_thread(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    early = etq.start(_config())
    early.finish(timeout_s=CHILD_TIMEOUT_S)
    assert not early._thread.is_alive() and not early.created and early.error is None


def test_a_failed_start_ends_its_controller_so_the_task_runner_cannot_wait_for_ever(monkeypatch, capsys):
    killed = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: (name, namespace))
    monkeypatch.setattr(ray, "kill", killed.append)

    def init(conf):
        raise RuntimeError("storage unit 0 died")

    monkeypatch.setitem(sys.modules, "transfer_queue", types.SimpleNamespace(init=init))
    early = etq.start(_config())
    early.finish(timeout_s=CHILD_TIMEOUT_S)
    assert killed == [("TransferQueueController", "transfer_queue")]
    assert isinstance(early.error, RuntimeError) and not early.created
    assert "early start failed: RuntimeError: storage unit 0 died" in capsys.readouterr().out


CHILD = textwrap.dedent("""
    import json, sys, time
    import ray
    from omegaconf import OmegaConf
    from populora_verl.trainer import early_transfer_queue as etq

    config = OmegaConf.create(json.loads(sys.argv[2]))
    early = etq.start(config)  # as the start-up callback does, before verl's main starts Ray
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])

    @ray.remote
    class TaskRunner:  # what verl's task runner does with TransferQueue: tq.init with its section, then data
        def run(self, conf):
            import torch
            import transfer_queue as tq
            from tensordict import TensorDict
            from transfer_queue import interface

            # verl's task runner reaches tq.init after importing verl, long after the launcher's start; here the
            # actor imports little, so it waits for the controller's name (TransferQueue's own handling of the other
            # order, both creating it, is not what this test is about)
            while True:
                try:
                    ray.get_actor("TransferQueueController", namespace="transfer_queue")
                    break
                except ValueError:
                    time.sleep(0.05)
            tq.init(OmegaConf.create(conf))
            owns_storage = interface._TQ_STORAGE is not None
            tq.kv_batch_put(keys=["a", "b"], partition_id="p",
                            fields=TensorDict({"x": torch.arange(4).view(2, 2)}, batch_size=2))
            got = tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["x"])["x"]
            got = [row.tolist() for row in got.unbind(0)]  # one row a key (a nested tensor)
            tq.close()  # verl's task runner closes at the end of its run: its client and the controller
            return owns_storage, got

    owns_storage, got = ray.get(TaskRunner.remote().run.remote(etq.tq_conf(config)))
    created, seconds = early.created, early.seconds
    early.finish()
    left = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "TransferQueue" in a["name"])
    print("RESULT " + json.dumps({"created": created, "seconds": seconds, "owns_storage": owns_storage,
                                  "got": got, "left": left, "error": repr(early.error)}))
""")


def test_the_task_runner_attaches_to_the_transfer_queue_the_launcher_started(ray_tmpdir):
    config = OmegaConf.to_container(_config(), resolve=False)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", CHILD, ray_tmpdir, json.dumps(config)], capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S, env=env)
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result[0].split(" ", 1)[1])
    assert r["created"] and r["seconds"] is not None and r["error"] == "None"
    assert r["owns_storage"] is False  # it attached: the launcher's storage units carried its data
    assert r["got"] == [[0, 1], [2, 3]]
    assert r["left"] == []  # the task runner's close ended the controller, the launcher's the storage units
    assert "[populora] TransferQueue: started by the launching process" in proc.stdout


def test_the_recipes_start_up_callback_starts_it_and_ends_it_with_the_job(monkeypatch):
    from populora_verl import startup

    from _shared import compose_recipe

    started, finished = [], []

    class Early:
        def finish(self):
            finished.append(True)

    monkeypatch.setattr(startup, "preflight", lambda config, check_gpus: None)  # no GPU, no model here
    monkeypatch.setattr(startup, "claim_trainer_run_dir", lambda config: None)
    monkeypatch.setattr(etq, "start", lambda config: started.append(etq.tq_conf(config)) or Early())
    cfg = compose_recipe("qwen1.5b_1gpu_2t2s")
    cb = startup.PreflightCallback(check_gpus=False)
    cb.on_run_start(cfg)
    cb.on_job_start(cfg)
    assert started == [etq.tq_conf(cfg)] and started[0]["enable"] is True and not finished
    assert started[0]["backend"]["SimpleStorage"]["num_data_storage_units"] == 2  # the recipes' setting, resolved
    cb.on_job_end(cfg)
    assert finished == [True] and cb.early_tq is None
    assert compose_recipe("qwen1.5b_1gpu_2t2s").trainer.populora_early_transfer_queue is True  # the recipes' default
