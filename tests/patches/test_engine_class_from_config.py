"""0022: the training engine's class from config, ``EngineConfig.engine_class`` (the plugin's resident adapters change
the class of verl's FSDP engine instance after ``TrainingWorker`` built it)."""

from __future__ import annotations

PATCH = "0022-engine-class-from-config.patch"

# verl's own TrainingWorker.__init__ on CPU with the actor's engine config composed from verl's ppo_trainer.yaml, on a
# one-rank gloo group: the engine is the one registered for language_model / fsdp (looked up as on a GPU through
# VERL_ENGINE_DEVICE), a subclass named in fsdp_config.engine_class replaces it, anything else is refused. The FSDP
# engine's own __init__ (device mesh, model and optimizer on the accelerator) is the one stand-in: the worker only asks
# the built engine for its data-parallel rank.
CHECK = """
import atexit, glob, os, pathlib, shutil, sys, tempfile, types
import yaml
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import EngineConfig, TrainingWorkerConfig
from verl.workers.engine.fsdp import transformer_impl as impl
from verl.workers.engine_workers import TrainingWorker

CONFIG = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")

# every engine config verl ships, and every engine block of the generated full configs, declares the key (null)
def engine_blocks(node):
    if isinstance(node, dict):
        target = str(node.get("_target_", ""))
        if target.startswith("verl.workers.config.") and target.endswith("EngineConfig"):
            import verl.workers.config as wc
            cls = getattr(wc, target.rsplit(".", 1)[1])
            if issubclass(cls, EngineConfig):
                yield node
        for v in node.values():
            yield from engine_blocks(v)
    elif isinstance(node, list):
        for v in node:
            yield from engine_blocks(v)

files = sorted(glob.glob(os.path.join(CONFIG, "engine", "*.yaml")) + glob.glob(os.path.join(CONFIG, "_generated_*.yaml")))
blocks = [(f, b) for f in files for b in engine_blocks(yaml.safe_load(open(f)))]
assert len(blocks) >= 5 + 4 * 3, len(blocks)
missing = sorted({os.path.basename(f) for f, b in blocks if "engine_class" not in b})
assert not missing, f"engine_class is not declared in {missing}"
assert all(b["engine_class"] is None for _, b in blocks)

pathlib.Path("my_engines.py").write_text(
    "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead\\n"
    "class MyEngine(FSDPEngineWithLMHead):\\n    pass\\n"
    "class NotAnEngine:\\n    pass\\n")
sys.path.insert(0, os.getcwd())

root = tempfile.mkdtemp()
atexit.register(shutil.rmtree, root, True)
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", VERL_ENGINE_DEVICE="cuda")
dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)

def light_init(self, model_config, engine_config, optimizer_config, checkpoint_config):
    self.model_config, self.engine_config = model_config, engine_config
    self.ulysses_device_mesh = None

impl.FSDPEngine.__init__ = light_init

class Model(types.SimpleNamespace):
    def get(self, key, default=None):
        return getattr(self, key, default)

def engine(overrides):
    with initialize_config_dir(config_dir=CONFIG, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    assert "engine_class" in cfg.actor_rollout_ref.actor.fsdp_config, "engine_class is not declared"
    engine_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.fsdp_config)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=Model(use_remove_padding=True),
                                                 engine_config=engine_config))
    assert worker.engine.engine_config is engine_config
    return type(worker.engine)

import my_engines
assert engine([]) is impl.FSDPEngineWithLMHead
assert engine(["actor_rollout_ref.actor.fsdp_config.engine_class=my_engines.MyEngine"]) is my_engines.MyEngine
for wrong in ("my_engines.NotAnEngine", "verl.workers.engine.fsdp.transformer_impl.FSDPEngine"):
    try:
        engine([f"actor_rollout_ref.actor.fsdp_config.engine_class={wrong}"])
    except TypeError as e:
        msg = str(e)
        assert "engine_class" in msg and wrong in msg and "FSDPEngineWithLMHead" in msg and "\\n" not in msg, msg
    else:
        raise AssertionError(f"{wrong}, not a subclass of the registered engine, was accepted")

dist.destroy_process_group()
print("ok")
"""


def test_engine_class_is_read_from_config(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="engine_class is not declared")
