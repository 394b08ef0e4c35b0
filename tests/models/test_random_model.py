"""``python -m populora_verl.models random``: released shapes, a random model transformers loads, and a trainer
command that composes with hydra and passes the start-up check (built on the tiny plumbing shape, with a tokenizer
trained here: no download)."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import torch

from populora_verl import models
from populora_verl.bench.step_scaling import TRAINER_ENV
from populora_verl.random_model import (PLUMBING, SHAPES, checkpointing_note, dry_run_command, load_tokenizer,
                                        model_config, parameter_count, write_random_model)

from _shared import compose_recipe

# What each size's model card states (exact counts: the sum of the released checkpoint's tensors).
RELEASED_PARAMETERS = {"qwen2.5-coder-0.5b": 494_032_768, "qwen2.5-coder-1.5b": 1_543_714_304,
                       "qwen2.5-coder-3b": 3_085_938_688, "qwen2.5-coder-7b": 7_615_616_512,
                       "qwen2.5-coder-14b": 14_770_033_664, "qwen2.5-coder-32b": 32_763_876_352}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from populora_verl.local.tiny import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer().save_pretrained(d)
    return d


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_7b_and_14b_configs_are_the_released_ones():
    c = model_config(SHAPES["qwen2.5-coder-7b"]).to_dict()
    assert {k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                              "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")} \
        == dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False)
    assert c["rope_parameters"]["rope_theta"] == 1e6 and c["architectures"] == ["Qwen2ForCausalLM"]
    c = model_config(SHAPES["qwen2.5-coder-14b"]).to_dict()
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"]) == (5120, 48, 40, 8, 13824)
    assert model_config(SHAPES["qwen2.5-coder-1.5b"]).tie_word_embeddings is True


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMETERS))
def test_every_size_has_the_released_parameter_count(name):
    assert parameter_count(SHAPES[name]) == RELEASED_PARAMETERS[name]


def test_a_random_model_loads_in_transformers_and_is_reused_not_rebuilt(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    out, written = write_random_model(PLUMBING, tmp_path / "m", tokenizer_dir, shard_bytes=100_000)
    assert written and (out / "model.safetensors.index.json").is_file()  # several shards and their index
    config = json.loads((out / "config.json").read_text())
    assert config["populora_random_weights"]["shape"] == PLUMBING and config["hidden_size"] == 128
    assert config["vocab_size"] == len(load_tokenizer(tokenizer_dir))  # the tokenizer folder names no padded size
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.bfloat16
    q = model.model.layers[0].self_attn.q_proj.weight
    assert len(torch.unique(q)) == 2 and float(q.abs().max()) == pytest.approx(0.5 / 128 ** 0.5, rel=1e-2)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    before = sorted(p.stat().st_mtime_ns for p in out.iterdir())
    assert write_random_model(PLUMBING, out, tokenizer_dir) == (out, False)
    assert sorted(p.stat().st_mtime_ns for p in out.iterdir()) == before
    # the fast fill: the same tensors' shapes, one block repeated
    tiled, _ = write_random_model(PLUMBING, tmp_path / "t", tokenizer_dir, init="tiled")
    assert AutoModelForCausalLM.from_pretrained(tiled).model.embed_tokens.weight.shape == model.model.embed_tokens.weight.shape
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_flag_mistakes_are_one_line_naming_the_flag_before_any_weight(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "m"
    assert models.main(["random", PLUMBING, str(out), "--tokenizer-from", str(tmp_path / "empty")]) == 2
    assert _one_line(capsys).startswith(f"populora_verl.models: error: --tokenizer-from {tmp_path / 'empty'}: holds "
                                        "no tokenizer")
    assert models.main(["random", "qwen2.5-coder-7b", str(out), "--tokenizer-from", str(tokenizer_dir),
                        "--steps", "0"]) == 2
    assert _one_line(capsys) == "populora_verl.models: error: --steps 0: must be at least 1"
    assert models.main(["random", PLUMBING, str(out), "--tokenizer-from", str(tokenizer_dir),
                        "populora.pbt.cull_fraction=3"]) == 2
    assert _one_line(capsys) == "populora_verl.models: error: populora.pbt.cull_fraction: must be in (0, 1), got 3.0"
    assert models.main(["random", PLUMBING, str(out), "--tokenizer-from", str(tokenizer_dir), "--recipe", "4t4"]) == 2
    assert _one_line(capsys).startswith("populora_verl.models: error: --recipe 4t4: no such recipe; known: [")
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text("{}")
    assert models.main(["random", PLUMBING, str(real), "--tokenizer-from", str(tokenizer_dir)]) == 2
    assert "is not a random model this command wrote" in _one_line(capsys)
    assert not out.exists() and (real / "config.json").read_text() == "{}"


def test_a_tokenizer_larger_than_the_shapes_vocabulary_is_refused(tmp_path, tokenizer_dir):
    from dataclasses import replace

    from populora_verl.cli_errors import UsageError

    small = replace(SHAPES[PLUMBING], vocab_size=100)
    with pytest.raises(UsageError, match=r"^--tokenizer-from .*: its tokenizer has \d+ tokens, more than the model's "
                                         r"100 embeddings"):
        write_random_model(small, tmp_path / "m", tokenizer_dir)


def _printed_command(capsys) -> list[str]:
    line = capsys.readouterr().out.strip().splitlines()[-1]
    words = shlex.split(line)
    env = [w for w in words[:len(TRAINER_ENV)]]
    assert env == [f"{k}={v}" for k, v in TRAINER_ENV.items()]
    assert words[len(TRAINER_ENV):len(TRAINER_ENV) + 3] == ["python", "-m", "verl.trainer.main_ppo"]
    return words[len(TRAINER_ENV):]


@pytest.mark.parametrize("recipe", ["4t4s", "azr_single_agent"])
def test_the_printed_command_composes_and_passes_the_start_up_check(tmp_path, tokenizer_dir, capsys, recipe):
    from populora_verl.startup import preflight

    out = tmp_path / "m"
    assert models.main(["random", PLUMBING, str(out), "--tokenizer-from", str(tokenizer_dir), "--recipe", recipe,
                        "--gpus", "4", "--steps", "6", "--run-dir", str(tmp_path / "run"),
                        "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]) == 0
    cmd = _printed_command(capsys)
    assert cmd[cmd.index("--config-name") + 1] == recipe
    overrides = cmd[cmd.index("--config-name") + 2:]
    cfg = compose_recipe(recipe, overrides)
    preflight(cfg, check_gpus=False)
    assert cfg.actor_rollout_ref.model.path == str(out.resolve())
    assert cfg.actor_rollout_ref.rollout.ignore_eos is True and cfg.data.max_response_length == 1024
    assert cfg.populora.rollout.max_new_tokens is None  # the forced length is the response length
    assert (cfg.trainer.total_training_steps, cfg.trainer.n_gpus_per_node, cfg.trainer.save_freq) == (6, 4, -1)
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert (cfg.populora.pbt.interval_steps, cfg.populora.pbt.min_age, cfg.populora.buffer.seed_programs) == (2, 0, 0)
    assert not (tmp_path / "run").exists()  # printing runs nothing


def test_run_starts_the_printed_command_with_the_trainer_environment(tmp_path, tokenizer_dir, capsys, monkeypatch):
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 7)
    assert models.main(["random", PLUMBING, str(tmp_path / "m"), "--tokenizer-from", str(tokenizer_dir),
                        "--recipe", "smoke_0.5b", "--profile", "varlen_wide_keep_liger", "--run",
                        "trainer.save_freq=2"]) == 7
    printed = _printed_command(capsys)
    (cmd, env), = calls
    assert cmd == [sys.executable, *printed[1:]]
    assert all(env[k] == v for k, v in TRAINER_ENV.items()) and env["POPULORA_LORA_FORWARD"] == "lean"
    assert "trainer.save_freq=2" in cmd and "trainer.save_freq=-1" not in cmd  # the user's value replaces ours
    assert "actor_rollout_ref.model.use_liger=true" in cmd


def test_a_large_shape_without_gradient_checkpointing_gets_a_note(tmp_path):
    ckpt = "actor_rollout_ref.model.enable_gradient_checkpointing"
    off = dry_run_command(tmp_path, "4t4s", profile="varlen_wide_keep_liger")
    assert f"{ckpt}=false" in off  # what the profile sets, so the note is about the command as printed
    note = checkpointing_note(SHAPES["qwen2.5-coder-7b"], off)
    assert note and "\n" not in note and f"{ckpt}=true" in note, note
    kept = dry_run_command(tmp_path, "4t4s", profile="varlen_wide_keep_liger", overrides=[f"{ckpt}=true"])
    assert checkpointing_note(SHAPES["qwen2.5-coder-7b"], kept) is None
    assert checkpointing_note(SHAPES["qwen2.5-coder-1.5b"], off) is None  # where the profiles were measured
    assert checkpointing_note(SHAPES["qwen2.5-coder-7b"], dry_run_command(tmp_path, "4t4s")) is None  # recipe's own
