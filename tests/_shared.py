"""Plain helpers the test modules import (conftest.py puts this folder on sys.path).

Fixtures live in conftest.py; what is here is needed outside a test's arguments: in module-level helpers and in
values a module builds at import time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Paths from here, never from a test module's own __file__: the modules sit one folder down (tests/<area>/), and
# a later move of a module must not change what these name.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"
RECIPES = REPO / "recipes" / "populora"


def compose_recipe(name: str, overrides=(), *, hydra_config: bool = False):
    """The recipe ``name`` composed by hydra as ``verl.trainer.main_ppo --config-path recipes/populora`` would.

    ``hydra_config``: keep the ``hydra`` node (callbacks and the like), which a plain compose drops."""
    # Imported here: some modules skip themselves when hydra is missing, which they can only do before this runs.
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=name, overrides=list(overrides), return_hydra_config=hydra_config)


# --- a small population step: one code_o task type, answers written by the test ----------------------------------

PROGRAM = "def f(x):\n    return x + 1\n"
GOOD_PROPOSAL = f"plan</think>\n<answer>\n```python\n{PROGRAM}```\n```input\n3\n```\n</answer>"
GARBAGE = "no idea what to write"
RIGHT = "4 it is</think>\n<answer>\n```output\n4\n```\n</answer>"
WRONG = "maybe 5</think>\n<answer>\n```output\n5\n```\n</answer>"


def small_step_config(proposals_per_type: int = 1, **over):
    """2T2S on code_o with round-robin matchmaking, evolution every step and a small CVT archive; ``over`` merges
    into a section (``pbt={"enabled": False}``)."""
    from populora_verl.config import load_config

    base = {
        "population": {"num_teachers": 2, "num_students": 2},
        "matchmaking": {"method": "round_robin"},
        "tasks": {"types": ["code_o"], "num_references": 1},
        "rollout": {"teacher_n": 1, "student_n": 4, "proposals_per_type": proposals_per_type},
        "pbt": {"interval_steps": 1},
        "diagnostics": {"cvt_cells": 8, "cvt_samples": 500},
    }
    for k, v in over.items():
        base.setdefault(k, {}).update(v)
    return load_config(base)


def answer_with(requests, fn):
    """One response per request: ``fn(request, k)`` for each of its ``request.n`` completions."""
    from populora_verl.step import GenResponse

    return [GenResponse(r, [fn(r, k) for k in range(r.n)], lengths=[5] * r.n) for r in requests]


class FakeRollout:
    """The worker's rollout side without vLLM: records every weight push."""

    def __init__(self):
        self.pushes = []
        self.sleep_level = 2

    async def resume(self, tags):
        pass

    async def update_weights(self, weights, **kwargs):
        self.pushes.append(({k: v.clone() for k, v in weights}, kwargs))


def bare_worker(training_worker, *, base_sync_done: bool = False):
    """PopuLoRA's actor worker built with ``__new__`` around a fake verl training worker (verl's FSDP engine and
    vLLM are GPU-only), with a :class:`FakeRollout`."""
    from omegaconf import OmegaConf

    from populora_verl.workers.worker import PopuLoRAActorRolloutRefWorker

    w = PopuLoRAActorRolloutRefWorker.__new__(PopuLoRAActorRolloutRefWorker)
    w.config = OmegaConf.create({"actor": {"strategy": "fsdp2"},
                                 "rollout": {"checkpoint_engine": {"backend": "naive"}, "free_cache_engine": False}})
    w.role = "actor_rollout"
    w.actor = training_worker
    w.rollout = FakeRollout()
    w.enable_routing_replay = False
    w.base_sync_done = base_sync_done
    w.layered_summon = False
    w.peft_merge = False
    w._rank, w._world_size = 0, 1
    return w


#: The start of a script that drives verl's own trainer on the CPU in a fresh interpreter: verl's trainer classes, a
#: private temporary folder (removed at exit) and an ``events`` list for the script's recorders.
TRAINER_SCRIPT_PRELUDE = """
import atexit, os, shutil, tempfile
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

root = tempfile.mkdtemp()
tempfile.tempdir = root  # verl's checkpoint lock files too: the test leaves nothing in /tmp, failed or not
atexit.register(shutil.rmtree, root, True)
events = []
"""

#: verl's trainer workers and dataloader replaced by recorders of what verl's save and resume do with them (the step
#: folder each call names), for the checks that run verl's real ``_save_checkpoint`` / ``_load_checkpoint`` on CPU.
TRAINER_RECORDERS = """

class Workers:
    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)
        events.append(("actor saved", os.path.basename(os.path.dirname(local_path))))
    def load_checkpoint(self, local_path, **kwargs):
        events.append(("actor loaded", os.path.basename(os.path.dirname(local_path))))

class Loader:
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass

def recording_trainer(cls, mode):
    # a cls (registered as mode) on verl's default config, saving under root, with the recorders
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[f"trainer.v1.trainer_mode={mode}",
                                                           f"trainer.default_local_dir={root}"])
    t = cls(cfg)
    t.trainer_mode, t.is_async = "sync", False  # a sync trainer under its own name (patch 0007 or not)
    t.actor_rollout_wg, t.train_dataloader, t.use_critic = Workers(), Loader(), False
    return t
"""


def needs_vllm(what: str) -> pytest.MarkDecorator:
    """Skip a test that calls into vLLM itself (``what``: the part it uses) where vLLM is not installed."""
    return pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                              reason=f"needs vLLM ({what}); runs where vLLM is installed")
