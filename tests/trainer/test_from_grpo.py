"""docs/from-grpo.md: verl's GRPO example plus the page's diff is a PopuLoRA run that passes the start-up check;
the plugin sets what the population needs and prints it once; a contradicting value stops the run in one line
naming the key; a GRPO config without the keys stays plain GRPO. Hydra compose on CPU: no GPU, no Ray."""

from __future__ import annotations

import re
import shlex

import pytest

hydra = pytest.importorskip("hydra")

from omegaconf import OmegaConf  # noqa: E402

from populora_verl.config import ConfigError, load_config  # noqa: E402
from populora_verl.startup import PreflightCallback, preflight  # noqa: E402
from populora_verl.trainer import enable, verl_config  # noqa: E402

from _shared import REPO, SideBySide, compose_recipe, start_early  # noqa: E402

PAGE = REPO / "docs" / "from-grpo.md"
CALLBACK = "+hydra.callbacks.populora_preflight._target_=populora_verl.startup.PreflightCallback"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def _overrides(text: str) -> list[str]:
    words = shlex.split(" ".join(line.rstrip().rstrip("\\") for line in text.splitlines()))
    return [w for w in words if "=" in w]  # drops "python3 -m verl.trainer.main_ppo"


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


EXAMPLE = _overrides(_blocks("bash")[0])
_DIFF = [line for line in _blocks("diff")[0].splitlines() if line[:1] in "+-"]
ADDED = _overrides("\n".join(line[1:] for line in _DIFF if line.startswith("+")))
REMOVED = _overrides("\n".join(line[1:] for line in _DIFF if line.startswith("-")))


def with_diff(extra=()) -> list[str]:
    """The example's overrides with the diff applied (a removed line goes, an added one comes), then ``extra``."""
    kept = [o for o in EXAMPLE if o not in REMOVED]
    return kept + ADDED + list(extra)


def compose_verl(overrides) -> object:
    """verl's own ppo_trainer.yaml composed with ``overrides``, the hydra node kept (callbacks live there)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides), return_hydra_config=True)


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.fixture(autouse=True)
def _hub_ids_allowed(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the example's model is a hub id


def test_the_page_holds_the_example_and_a_diff_of_five_keys_at_most():
    assert "algorithm.adv_estimator=grpo" in EXAMPLE and "actor_rollout_ref.rollout.n=5" in EXAMPLE
    assert all(o in EXAMPLE for o in REMOVED), "a removed line must be one of the example's"
    keys = {_key(o) for o in ADDED + REMOVED}
    assert len(keys) <= 5 and "populora.enable" in keys, keys
    assert "+populora.enable=true" in ADDED and CALLBACK in ADDED


def test_the_grpo_example_with_the_diff_passes_the_start_up_check(capsys):
    cfg = compose_verl(with_diff())
    assert cfg.hydra.callbacks.populora_preflight._target_ == "populora_verl.startup.PreflightCallback"
    PreflightCallback(check_gpus=False).on_run_start(cfg)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("set for PopuLoRA: "), out
    assert out[0] in PAGE.read_text(), "the page shows the line the example prints"
    for key, value in [("trainer.v1.trainer_mode", "populora"), ("algorithm.adv_estimator", "populora_trrpp"),
                       ("actor_rollout_ref.rollout.agent.default_agent_loop", "populora_agent"),
                       ("reward.reward_manager.name", "populora_code"), ("actor_rollout_ref.rollout.n", 1),
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", 1024), ("populora.rollout.student_n", 5),
                       ("data.train_files", None), ("actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras", 8)]:
        assert OmegaConf.select(cfg, key) == value, key
        assert f"{key}={'null' if value is None else value}" in out[0]
    # The user's own values stay: model, parallel layout, lengths, the LoRA choices of the diff.
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2 and cfg.data.max_response_length == 2048
    assert cfg.actor_rollout_ref.model.lora_rank == 16 and cfg.actor_rollout_ref.actor.optim.lr == 1e-4
    assert enable.apply_populora_settings(cfg, dry_run=True) == []  # what on_job_start finds: nothing left
    preflight(cfg, check_gpus=False)
    # verl's main validates the same config next (the task function gets it without the hydra node).
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    task_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    assert not need_critic(task_cfg) and not need_reference_policy(task_cfg)
    validate_config(task_cfg, use_reference_policy=False, use_critic=False)


@pytest.mark.parametrize("extra", [[], ["+populora.enable=false"]], ids=["no populora keys", "enable=false"])
@pytest.mark.parametrize("callback", [False, True], ids=["without callback", "with callback"])
def test_a_grpo_config_without_the_keys_runs_as_plain_grpo(extra, callback, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written; if it were, it lands here
    cfg = compose_verl(EXAMPLE + ([CALLBACK] if callback else []) + extra)
    before = _plain(cfg)
    cb = PreflightCallback(check_gpus=False)
    cb.on_run_start(cfg)
    cb.on_job_start(cfg)
    cb.on_job_end(cfg)
    assert _plain(cfg) == before and capsys.readouterr() == ("", "")
    assert cfg.trainer.v1.trainer_mode == "sync" and cfg.algorithm.adv_estimator == "grpo" and cb.lock is None
    assert list(tmp_path.iterdir()) == []


CONTRADICTIONS = [
    ("trainer.v1.trainer_mode=separate_async", "trainer.v1.trainer_mode"),
    ("trainer.use_v1=false", "trainer.use_v1"),
    ("algorithm.adv_estimator=rloo", "algorithm.adv_estimator"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
     "actor_rollout_ref.rollout.agent.default_agent_loop"),
    ("reward.reward_manager.name=dapo", "reward.reward_manager.name"),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy"),
    ("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "actor_rollout_ref.rollout.checkpoint_engine.backend"),
    ("critic.enable=true", "critic.enable"),
    ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras=3", "actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras=4",
     "actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras"),
    # two values for one shape: GRPO's group size and PopuLoRA's answers per task
    ("+populora.rollout.student_n=8", "actor_rollout_ref.rollout.n"),
    ("+populora.enable=yes", "populora.enable"),
]


@pytest.mark.parametrize("override,key", CONTRADICTIONS, ids=[k for _, k in CONTRADICTIONS])
def test_a_contradicting_value_stops_the_run_in_one_line_naming_the_key(override, key, capsys):
    overrides = with_diff([override])
    if override.startswith("+populora.enable="):
        overrides.remove("+populora.enable=true")
    cfg = compose_verl(overrides)
    before = _plain(cfg)
    with pytest.raises(SystemExit) as e:
        PreflightCallback(check_gpus=False).on_run_start(cfg)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"populora: {key}: ") and err.count("\n") == 1, err
    assert _plain(cfg) == before  # nothing was set


def test_a_populora_section_without_enable_stops_instead_of_being_ignored(capsys):
    cfg = compose_verl(EXAMPLE + [CALLBACK, "+populora.population.num_teachers=2"])
    with pytest.raises(SystemExit):
        PreflightCallback(check_gpus=False).on_run_start(cfg)
    assert capsys.readouterr().err.startswith("populora: populora.enable: the config has a populora section")


def test_enable_false_on_the_population_trainer_stops(capsys):
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", "populora.enable=false"], hydra_config=True)
    with pytest.raises(SystemExit):
        PreflightCallback(check_gpus=False).on_run_start(cfg)
    assert capsys.readouterr().err.startswith("populora: populora.enable: false, but trainer.v1.trainer_mode")


def test_user_values_above_the_population_s_needs_stay():
    cfg = compose_verl(with_diff(["+actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras=32",
                                  "data.max_prompt_length=8192", "+populora.rollout.student_n=5"]))
    changes = dict(enable.apply_populora_settings(cfg))
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras == 32 and cfg.data.max_prompt_length == 8192
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras == 32  # >= max_loras
    assert "populora.rollout.student_n" not in changes and cfg.actor_rollout_ref.rollout.n == 1
    # a cache smaller than the default's twice the population, but no smaller than max_loras, is the user's call
    cfg = compose_verl(with_diff(["+actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras=10"]))
    enable.apply_populora_settings(cfg)
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras == 10


NOT_POPULORA = [
    ("trainer.v1.trainer_mode", "sync"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop", "single_turn_agent"),
    ("reward.reward_manager.name", "naive"),
    ("algorithm.adv_estimator", "grpo"),
]


@pytest.mark.parametrize("key,value", NOT_POPULORA, ids=[k for k, _ in NOT_POPULORA])
def test_the_start_up_check_refuses_a_config_that_is_not_a_populora_run(key, value):
    cfg = compose_verl(with_diff())
    enable.apply_populora_settings(cfg)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, check_gpus=False)
    assert str(e.value).startswith(f"{key}: must be ") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        verl_config.validate_verl_config(cfg, __import__("populora_verl.config").config.load_config(cfg.populora))


def test_a_job_that_skipped_on_run_start_lists_the_keys_to_set(capsys):
    """Hydra's --multirun calls on_job_start without on_run_start: the job stops and names what to set."""
    cfg = compose_verl(with_diff())
    with pytest.raises(SystemExit):
        PreflightCallback(check_gpus=False).on_job_start(cfg)
    err = capsys.readouterr().err
    assert err.startswith("populora: populora.enable: these keys were not set") and err.count("\n") == 1
    assert "trainer.v1.trainer_mode=populora" in err


@pytest.mark.parametrize("name", ["smoke_0.5b", "4t4s", "azr_single_agent", "qwen1.5b_1gpu_2t2s"])
def test_a_recipe_needs_nothing_set(name, capsys):
    cfg = compose_recipe(name, ["actor_rollout_ref.model.path=/m"], hydra_config=True)
    before = _plain(cfg)
    PreflightCallback(check_gpus=False).on_run_start(cfg)
    assert _plain(cfg) == before and capsys.readouterr().out == ""


def test_the_settings_name_the_plugin_s_registrations():
    from populora_verl.plugin import EXPECTED

    registered = dict((what, name) for what, name in EXPECTED)
    values = {s.key: s.value for s in enable.SETTINGS}
    assert values["trainer.v1.trainer_mode"] == registered["trainer"]
    assert values["algorithm.adv_estimator"] == registered["adv_estimator"]
    assert values["reward.reward_manager.name"] == registered["reward_manager"]
    assert values["actor_rollout_ref.rollout.name"] == registered["rollout"]
    assert values["actor_rollout_ref.rollout.agent.default_agent_loop"] == registered["agent_loop"]


def _job(args, cwd) -> dict:
    """``subprocess.run`` arguments of ``python *args`` in ``cwd`` (for :func:`_shared.run_side_by_side`)."""
    import os
    import sys

    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("HF_HUB_OFFLINE", None)
    return {"args": [sys.executable, *args], "cwd": cwd, "env": env}


_APP = (
    "import hydra\n"
    "@hydra.main(config_path='pkg://verl.trainer.config', config_name='ppo_trainer', version_base=None)\n"
    "def main(cfg):\n"
    "    print('task:', cfg.trainer.v1.trainer_mode, cfg.algorithm.adv_estimator,\n"
    "          cfg.actor_rollout_ref.rollout.agent.default_agent_loop, cfg.reward.reward_manager.name,\n"
    "          cfg.actor_rollout_ref.rollout.n, cfg.populora.rollout.student_n)\n"
    "main()\n")


@pytest.fixture(scope="module")
def own_runs(tmp_path_factory):
    """The two fresh interpreters below, side by side, each in a folder of its own: name -> (its runs, its folder)."""
    app_dir, main_dir = tmp_path_factory.mktemp("hydra_app"), tmp_path_factory.mktemp("verl_main")
    app = app_dir / "app.py"
    app.write_text(_APP)
    runs = SideBySide({
        "app": _job([str(app), *with_diff(["+hydra.callbacks.populora_preflight.check_gpus=false"])], app_dir),
        "verl_main": _job(["-m", "verl.trainer.main_ppo",
                           *with_diff(["actor_rollout_ref.model.path=/nonexistent/model"])], main_dir),
    })
    yield {"app": (runs, app_dir), "verl_main": (runs, main_dir)}
    runs.close()


@pytest.fixture(scope="module", autouse=True)
def _own_runs_start_with_the_module(request):
    start_early(request, "own_runs")  # they run beside the compose tests above


def test_what_the_callback_sets_is_what_the_task_function_gets(own_runs):
    """Through Hydra itself, not the compose API: verl's main is a ``@hydra.main`` task function on
    ``ppo_trainer``, and gets the config Hydra copies after ``on_run_start``."""
    r = own_runs["app"][0].result("app")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert sum(line.startswith("set for PopuLoRA: ") for line in lines) == 1, r.stdout
    assert "task: populora populora_trrpp populora_agent populora_code 1 5" in lines, r.stdout


def test_verl_main_prints_the_settings_once_then_stops_before_ray_on_a_bad_key(own_runs):
    """The real command: the callback comes from the command line, sets and prints before any check, and a
    failed check still ends it in one line before Ray starts."""
    runs, folder = own_runs["verl_main"]
    r = runs.result("verl_main")
    assert r.returncode == 2, r.stderr[-2000:]
    assert sum(line.startswith("set for PopuLoRA: ") for line in r.stdout.splitlines()) == 1, r.stdout
    assert r.stderr.strip().splitlines()[-1] == ("populora: actor_rollout_ref.model.path: no such directory "
                                                 "'/nonexistent/model'")
    assert "ray init" not in r.stdout.lower() and "Traceback" not in r.stderr
    assert sorted(p.name for p in folder.iterdir()) == []  # no Hydra outputs/ folder, no run directory


BACKEND = "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend"


@pytest.mark.parametrize("name", ["smoke_0.5b", "4t4s", "azr_single_agent", "qwen1.5b_1gpu_2t2s", "qwen1.5b_4gpu_4t4s"])
def test_the_recipes_run_a_one_gpu_replica_in_vllms_engine_process(name):
    assert OmegaConf.select(compose_recipe(name), BACKEND) == "uni"


@pytest.mark.parametrize(
    "layout, spans",
    [
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"], 2),
        (["actor_rollout_ref.rollout.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=4"], 2),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.data_parallel_size=2",
          "trainer.n_gpus_per_node=4"], 4),
    ],
)
def test_a_larger_replica_set_on_a_recipe_runs_vllms_multiprocess_executor(layout, spans, capsys):
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", *layout], hydra_config=True)
    PreflightCallback(check_gpus=False).on_run_start(cfg)
    assert OmegaConf.select(cfg, BACKEND) == "mp"
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"{BACKEND}=mp" in out  # the one start-up line says so
    assert enable.apply_populora_settings(cfg, dry_run=True) == []  # nothing left to set afterwards
    raw = compose_recipe("smoke_0.5b", layout)
    why = [s.why for s in enable.populora_settings(raw, load_config(raw.populora)) if s.key == BACKEND]
    assert len(why) == 1 and f"spans {spans}" in why[0]


def test_a_users_own_executor_stays():
    cfg = compose_recipe("smoke_0.5b", [f"{BACKEND}=mp"])
    assert enable.apply_populora_settings(cfg, dry_run=True) == []
    assert OmegaConf.select(cfg, BACKEND) == "mp"
