"""Start-up checks run before Ray/TransferQueue: a Hydra callback in the recipes ends a bad run in one line."""

from __future__ import annotations

import os
import re
import sys

import pytest
from omegaconf import OmegaConf

from populora_verl.config import ConfigError
from populora_verl.startup import preflight

from _shared import RECIPES, REPO, SideBySide, compose_recipe, start_early


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return tmp_path / "m"


@pytest.mark.parametrize("recipe", ["1t1s", "2t2s", "4t4s", "8t8s", "azr_single_agent", "smoke_0.5b"])
def test_every_recipe_declares_the_preflight_callback(recipe):
    cfg = compose_recipe(recipe, ["actor_rollout_ref.model.path=/m"], hydra_config=True)
    assert cfg.hydra.callbacks.populora_preflight._target_ == "populora_verl.startup.PreflightCallback"


def test_model_path_is_checked(tmp_path, model_dir, monkeypatch):
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.path: no such directory '/nonexistent'$"):
        preflight(compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/nonexistent"]), check_gpus=False)
    with pytest.raises(ConfigError, match=r"holds no HF model \(no config.json\)"):
        preflight(compose_recipe("smoke_0.5b", [f"actor_rollout_ref.model.path={tmp_path}"]), check_gpus=False)
    preflight(compose_recipe("smoke_0.5b", [f"actor_rollout_ref.model.path={model_dir}"]), check_gpus=False)
    # "org/name" is a hub id unless the hub is switched off
    preflight(compose_recipe("2t2s", ["actor_rollout_ref.model.path=Qwen/Qwen2.5-Coder-7B"]), check_gpus=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        preflight(compose_recipe("2t2s", ["actor_rollout_ref.model.path=Qwen/Qwen2.5-Coder-7B"]), check_gpus=False)


@pytest.mark.parametrize("recipe", ["smoke_0.5b", "qwen1.5b_1gpu_2t2s", "qwen1.5b_1gpu_single", "qwen1.5b_4gpu_4t4s"])
def test_a_one_gpu_recipe_without_a_model_stops_instead_of_taking_the_7b(recipe):
    """The one-GPU recipes name no model; the base's paper model must not fill the gap (a 1.5B run silently
    downloading and training the 7B), nor may verl's own placeholder path pass for a folder that is missing."""
    cfg = compose_recipe(recipe)
    assert "7B" not in str(cfg.actor_rollout_ref.model.path)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.path: is required"):
        preflight(cfg, check_gpus=False)
    # the paper recipes keep theirs
    assert compose_recipe("4t4s").actor_rollout_ref.model.path == "Qwen/Qwen2.5-Coder-7B"


def test_gpus_and_keys_are_checked(model_dir, monkeypatch):
    import torch

    cfg = compose_recipe("2t2s", [f"actor_rollout_ref.model.path={model_dir}"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"^trainer\.n_gpus_per_node: 8 GPU\(s\) requested but no GPU is visible"):
        preflight(cfg)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"8 GPUs requested but 2 visible.*trainer\.n_gpus_per_node=2"):
        preflight(cfg)
    monkeypatch.setattr("populora_verl.checks.vllm_missing", lambda: None)  # this CPU machine has no vLLM
    monkeypatch.setattr("populora_verl.startup._flash_attn_2_available", lambda: True)  # nor flash-attn
    preflight(compose_recipe("2t2s", [f"actor_rollout_ref.model.path={model_dir}", "trainer.n_gpus_per_node=2"]))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.name: must be 'populora_vllm'"):
        preflight(compose_recipe("2t2s", [f"actor_rollout_ref.model.path={model_dir}",
                                          "actor_rollout_ref.rollout.name=vllm"]))
    with pytest.raises(ConfigError, match=r"^populora\.pbt\.cull_fraction: must be in \(0, 1\)"):
        preflight(compose_recipe("2t2s", [f"actor_rollout_ref.model.path={model_dir}",
                                          "populora.pbt.cull_fraction=1.5"]))


def test_names_the_config_refers_to_are_checked_before_ray(model_dir, tmp_path):
    """An unknown operator or a missing seed file used to pass, to fail minutes in at their first use."""
    args = [f"actor_rollout_ref.model.path={model_dir}"]
    with pytest.raises(ConfigError, match=r"^populora\.pbt\.operators\.nosuchop: unknown operator; known: \["):
        preflight(compose_recipe("smoke_0.5b", args + ["populora.pbt.operators={nosuchop:1.0}"]), check_gpus=False)
    with pytest.raises(ConfigError, match=r"^populora\.pbt\.operator_params\.neftune\.eps: neftune does not accept"):
        preflight(compose_recipe("smoke_0.5b", args + ["++populora.pbt.operator_params={neftune:{eps:1}}"]),
                  check_gpus=False)
    missing = tmp_path / "seeds.jsonl"
    with pytest.raises(ConfigError, match=rf"^populora\.buffer\.seed_file: no such file '{missing}'"):
        preflight(compose_recipe("smoke_0.5b", args + [f"++populora.buffer.seed_file={missing}"]), check_gpus=False)
    # another run's seed set, awaited at the first step (bench.learning_run's arms)
    preflight(compose_recipe("smoke_0.5b", args + [f"++populora.buffer.seed_file={missing}",
                                                   "++populora.buffer.seed_file_wait_s=60"]), check_gpus=False)
    missing.write_text('{"input": "1"}\n')
    with pytest.raises(ConfigError, match=r"^populora\.buffer\.seed_file: .*seeds\.jsonl:1: bad seed line"):
        preflight(compose_recipe("smoke_0.5b", args + [f"++populora.buffer.seed_file={missing}"]), check_gpus=False)
    missing.write_text('{"program": "def f(x):\\n    return x", "input": "1", "output": "1"}\n')
    preflight(compose_recipe("smoke_0.5b", args + [f"++populora.buffer.seed_file={missing}"]), check_gpus=False)


def test_a_cpu_device_and_a_missing_vllm_stop_before_ray(model_dir, monkeypatch):
    """trainer.device=cpu started Ray and hung; a missing vLLM showed only once the rollout workers imported it."""
    import torch

    args = [f"actor_rollout_ref.model.path={model_dir}"]
    with pytest.raises(ConfigError, match=r"^trainer\.device: .* use `python -m populora_verl\.local`$"):
        preflight(compose_recipe("smoke_0.5b", args + ["trainer.device=cpu"]), check_gpus=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.name: vLLM is not installed: "
                                          r"pip install 'verl\[vllm\]==0\.9\.1'"):
        preflight(compose_recipe("smoke_0.5b", args))


def test_flash_attention_without_its_package_stops_before_ray_and_other_attentions_pass(model_dir, monkeypatch):
    """A 7B dry run on a node without a flash-attn wheel failed in the FSDP workers' model init, two minutes in."""
    import torch

    from populora_verl.startup import ATTENTION_KEY

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("populora_verl.checks.vllm_missing", lambda: None)
    monkeypatch.setattr("populora_verl.startup._flash_attn_2_available", lambda: False)
    args = [f"actor_rollout_ref.model.path={model_dir}", "trainer.n_gpus_per_node=1"]
    with pytest.raises(ConfigError, match=rf"^{re.escape(ATTENTION_KEY)}: verl's default flash_attention_2 needs the "
                                          rf"flash-attn package.* or set \+\+{re.escape(ATTENTION_KEY)}=populora_varlen"):
        preflight(compose_recipe("2t2s", args))
    for impl in ("populora_varlen", "sdpa"):
        preflight(compose_recipe("2t2s", [*args, f"++{ATTENTION_KEY}={impl}"]))
    preflight(compose_recipe("2t2s", args), check_gpus=False)  # a CPU check of the config alone skips it
    monkeypatch.setattr("populora_verl.startup._flash_attn_2_available", lambda: True)
    preflight(compose_recipe("2t2s", args))


@pytest.fixture(scope="module")
def verl_main(tmp_path_factory):
    """``python -m verl.trainer.main_ppo`` with a recipe and a missing model, in a folder of its own, started with the
    module (its fresh interpreter runs beside the in-process tests): (its run, its folder)."""
    folder = tmp_path_factory.mktemp("verl_main")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name",
            "smoke_0.5b", "actor_rollout_ref.model.path=/nonexistent/model"]
    runs = SideBySide({"main": {"args": args, "cwd": folder, "env": env}})
    yield runs, folder
    runs.close()


@pytest.fixture(scope="module", autouse=True)
def _verl_main_starts_with_the_module(request):
    start_early(request, "verl_main")


def test_verl_main_stops_in_one_line_before_ray(verl_main):
    """The real entry point: ``python -m verl.trainer.main_ppo`` with a recipe and a missing model."""
    runs, folder = verl_main
    r = runs.result("main")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "populora: actor_rollout_ref.model.path: no such directory " \
                                                "'/nonexistent/model'"
    assert "Traceback" not in r.stderr and "ray" not in r.stdout.lower()
    # a failed start leaves no Hydra outputs/DATE/TIME/ folder behind, and no run directory
    assert sorted(p.name for p in folder.iterdir()) == []


@pytest.mark.parametrize("tie,fails", [(False, True), (True, False), (None, False)])
def test_fused_kernels_with_an_untied_head_stop_at_start_up(tmp_path, tie, fails):
    """verl's fused LM-head path fails under FSDP2 with an untied head (seen on an H100 with our 1.5B checkpoint,
    reproduced on CPU by tests/bench/test_logprob_paths.py::test_fused_kernels_under_fsdp2_need_a_tied_head): say so
    before Ray starts."""
    import json

    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({} if tie is None else {"tie_word_embeddings": tie}))
    cfg = compose_recipe("smoke_0.5b", [f"actor_rollout_ref.model.path={m}",
                                        "actor_rollout_ref.model.use_fused_kernels=true"])
    if fails:
        with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.use_fused_kernels: .*untied LM head"):
            preflight(cfg, check_gpus=False)
    else:
        preflight(cfg, check_gpus=False)
    # without the fused kernels an untied head is fine
    preflight(compose_recipe("smoke_0.5b", [f"actor_rollout_ref.model.path={m}"]), check_gpus=False)


def test_liger_kernels_need_their_package_at_start_up(model_dir, monkeypatch):
    """verl imports Liger inside each worker, minutes in: a missing package stops the command before Ray."""
    import importlib.util

    args = [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_liger=true"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.use_liger: the liger-kernel package is not "):
        preflight(compose_recipe("smoke_0.5b", args), check_gpus=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a))
    preflight(compose_recipe("smoke_0.5b", args), check_gpus=False)


def test_small_teacher_groups_warn_at_start_up_and_learning_recipes_do_not(model_dir, capsys):
    """A teacher's TRR++ group under 4 samples cannot learn while most proposals are invalid: say so before Ray."""
    preflight(compose_recipe("smoke_0.5b", [f"actor_rollout_ref.model.path={model_dir}"]), check_gpus=False)
    err = capsys.readouterr().err
    assert "populora: warning: populora.rollout.proposals_per_type: a teacher's TRR++ group has 2 sample(s)" in err
    for recipe in ("qwen1.5b_1gpu_2t2s", "qwen1.5b_1gpu_single"):
        preflight(compose_recipe(recipe, [f"actor_rollout_ref.model.path={model_dir}"]), check_gpus=False)
        assert "warning" not in capsys.readouterr().err


def test_a_plan_not_matched_per_adapter_stops_at_start_up_naming_the_keys(model_dir):
    """3 students cannot share 2 teachers' matches equally: one line naming the keys, before Ray starts."""
    args = [f"actor_rollout_ref.model.path={model_dir}"]
    with pytest.raises(ConfigError, match=r"^populora\.population\.num_students: .*matchmaking\.students_per_problem"):
        preflight(compose_recipe("2t2s", args + ["populora.population.num_students=3"]), check_gpus=False)
    with pytest.raises(ConfigError, match=r"^populora\.rollout\.buffer_task_n: "):
        preflight(compose_recipe("2t2s", args + ["populora.rollout.buffer_task_n=1"]), check_gpus=False)
    preflight(compose_recipe("2t2s", args + ["populora.population.num_teachers=4"]), check_gpus=False)


def test_compile_cache_is_on_in_recipes_and_refused_where_torch_writes_it_unsafely(model_dir, monkeypatch):
    import torch

    from populora_verl.startup import COMPILE_CACHE_KEY

    args = [f"actor_rollout_ref.model.path={model_dir}"]
    cfg = compose_recipe("qwen1.5b_4gpu_4t4s", args)
    # a string, as Ray wants env values; verl's own default of "1" sits below it in the merge
    assert OmegaConf.select(cfg, COMPILE_CACHE_KEY) == "0"
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    # what verl's main hands to ray.init: its defaults with the recipe's runtime_env merged on top
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), cfg.ray_kwargs.ray_init.runtime_env)
    assert runtime_env.env_vars.VLLM_DISABLE_COMPILE_CACHE == "0"
    assert runtime_env.env_vars.VLLM_ALLOW_RUNTIME_LORA_UPDATING == "true"  # verl's other defaults survive
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(ConfigError, match=rf"^{COMPILE_CACHE_KEY}: the compile cache needs torch >= 2.10"):
        preflight(cfg, check_gpus=False)
    preflight(compose_recipe("qwen1.5b_4gpu_4t4s", args + [f"{COMPILE_CACHE_KEY}='1'"]), check_gpus=False)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    preflight(cfg, check_gpus=False)


def test_an_unquoted_ray_env_value_stops_at_start_up_naming_the_key(model_dir):
    args = [f"actor_rollout_ref.model.path={model_dir}"]
    with pytest.raises(ConfigError, match=r"^ray_kwargs\.ray_init\.runtime_env\.env_vars\.VLLM_DISABLE_COMPILE_CACHE: "
                       r"Ray needs a string, got 1; quote it"):
        preflight(compose_recipe("smoke_0.5b", args + ["ray_kwargs.ray_init.runtime_env.env_vars."
                                                       "VLLM_DISABLE_COMPILE_CACHE=1"]), check_gpus=False)
    preflight(compose_recipe("smoke_0.5b", args + ["ray_kwargs.ray_init.runtime_env.env_vars."
                                                   "VLLM_DISABLE_COMPILE_CACHE='1'"]), check_gpus=False)
