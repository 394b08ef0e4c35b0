"""``python -m populora_verl.models random``: released shapes, a random model transformers loads, and a trainer
command that composes with hydra and passes the start-up check (built on the tiny plumbing shape, with a tokenizer
trained here: no download)."""

from __future__ import annotations

import json
import os
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


def _printed_command(out) -> list[str]:
    """The trainer's command as printed (``out``: the captured text, or capsys to read it)."""
    text = out if isinstance(out, str) else out.readouterr().out
    line = next(ln for ln in text.splitlines() if " verl.trainer.main_ppo " in ln)
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

    class FakeTrainer:  # prints two steps and fails: the summary still reads them
        def __init__(self, cmd, env, **kw):
            calls.append((cmd, env))
            self.stdout = iter([f"{STARTUP}\n", "noise\n", _console_line(1, 30.0, 50.0), _console_line(2, 20.0, 50.5)])
            self.pid = os.getpid()  # the run's own memory is then this test's process and whatever runs below it

        def wait(self):
            return 7

    monkeypatch.setattr(subprocess, "Popen", FakeTrainer)
    assert models.main(["random", PLUMBING, str(tmp_path / "m"), "--tokenizer-from", str(tokenizer_dir),
                        "--recipe", "smoke_0.5b", "--profile", "varlen_wide_keep_liger", "--steps", "2", "--run",
                        "trainer.save_freq=2"]) == 7
    out = capsys.readouterr().out
    assert "noise" in out and "dry run, exit code 7" in out and STARTUP.split("] ", 1)[1] in out
    assert "| 2 | 20.0 |" in out  # the summary's row of the second step
    own = [ln for ln in out.splitlines() if ln.startswith("[populora] dry run: step ")]
    # not after the last step's line: the trainer's processes are ending by then (on a GPU it read 4 GB against 65)
    assert [ln.split(",")[0] for ln in own] == ["[populora] dry run: step 1"]
    assert "run's own GB" in out and "the run's own memory: growth needs 2 steps from step 5 on" in out
    printed = _printed_command(out)
    (cmd, env), = calls
    assert cmd == [sys.executable, *printed[1:]]
    assert all(env[k] == v for k, v in TRAINER_ENV.items()) and env["POPULORA_LORA_FORWARD"] == "lean"
    assert "trainer.save_freq=2" in cmd and "trainer.save_freq=-1" not in cmd  # the user's value replaces ours
    assert "actor_rollout_ref.model.use_liger=true" in cmd


def test_against_runs_the_other_recipe_with_the_same_settings_and_prints_the_step_ratio(tmp_path, tokenizer_dir,
                                                                                         capsys, monkeypatch):
    import subprocess

    calls, rcs = [], [0, 0]

    class FakeTrainer:  # the population: 20 s steps, 26 s with evolution; the single agent: 10 s steps
        def __init__(self, cmd, env, **kw):
            calls.append(cmd)
            single = cmd[cmd.index("--config-name") + 1] == "azr_single_agent"
            self.stdout = iter([_console_line(1, 60.0, 50.0)] + [
                _console_line(s, 10.0 if single else 20.0 + 6 * (s % 2 == 0), 50.0,
                              evolve_s=None if single or s % 2 else 0.5) for s in range(2, 6)])
            self.pid, self.rc = os.getpid(), rcs[len(calls) - 1]

        def wait(self):
            return self.rc

    monkeypatch.setattr(subprocess, "Popen", FakeTrainer)
    args = ["random", PLUMBING, str(tmp_path / "m"), "--tokenizer-from", str(tokenizer_dir), "--recipe", "2t2s",
            "--steps", "5", "--against", "azr_single_agent", "--run-dir", str(tmp_path / "run"), "--run",
            "populora.rollout.student_n=4"]
    assert models.main(args) == 0
    out = capsys.readouterr().out
    pop, single = calls
    assert single[single.index("--config-name") + 1] == "azr_single_agent"
    assert "populora.rollout.student_n=4" in single and f"trainer.default_local_dir={tmp_path / 'run'}-azr_single_agent" in single
    assert not any(o.startswith("populora.pbt.interval_steps") for o in single)  # the baseline's own schedule
    assert any(o.startswith("populora.pbt.interval_steps=2") for o in pop)
    assert "[populora] dry run: step ratio 2t2s / azr_single_agent: 2.00x (steady step medians 20.0 s / 10.0 s)" in out

    # a failed first run: the other recipe is not started
    calls.clear()
    rcs[:] = [3, 0]
    assert models.main(args) == 3
    assert len(calls) == 1 and "azr_single_agent not run: the 2t2s run ended with exit code 3" in capsys.readouterr().out
    # one step has no steady step: refused before any weight is written
    assert models.main([*args[:7], "--steps", "1", *args[9:]]) == 2
    assert "--steps 1: the ratio with --against needs at least 2" in capsys.readouterr().err


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


STARTUP = ("(TaskRunnerV1 pid=7) [populora] start-up: ray + task runner 30 s | task runner imports 8 s | config + "
           "TransferQueue 20 s | workers + vLLM 90 s | checkpoint + weight sync 3 s | step 1 40 s | total 191 s")


def _console_line(step, step_s, host_gb, evolve_s=None, slot_host_gb=None):
    """verl's console logger line as a Ray actor prints it (only the keys the summary reads, plus one it ignores)."""
    m = {"timing_s/step": step_s, "timing_s/gen": step_s / 3, "timing_s/update_actor": step_s / 2,
         "timing_s/update_weights": 1.5, "actor/perf/max_memory_allocated_gb": 30.0,
         "actor/perf/cpu_memory_used_gb": host_gb, "critic/score/mean": -0.5}
    if slot_host_gb is not None:
        m["populora/s1/actor/perf/cpu_memory_used_gb"] = slot_host_gb
    if evolve_s is not None:
        m |= {"timing_s/populora_evolve": evolve_s, "populora/evolution/events": 1.0}
    return "(TaskRunnerV1 pid=7) step:%d - " % step + " - ".join(f"{k}:{v}" for k, v in m.items()) + "\n"


def test_the_dry_run_summary_reads_start_up_steady_steps_evolution_and_host_memory_growth():
    from populora_verl.random_model import dry_run_summary

    # host memory: 1 GB a step during the warm-up, then +0.05 GB a step; step 9's machine-wide peak is a slot's sample
    lines = [STARTUP + "\n"] + [
        _console_line(s, 60.0 if s == 1 else 30.0 + s % 2, 100.0 + min(s, 5) + 0.05 * max(s - 5, 0),
                      evolve_s=0.8 if s % 4 == 0 else None)
        for s in range(1, 16)
    ]
    lines[9] = _console_line(9, 31.0, 90.0, slot_host_gb=100.0 + 5 + 0.05 * 4)  # verl's mean hides the peak
    text = "".join(lines)
    summary = dry_run_summary(text).splitlines()
    assert summary[0] == STARTUP.split("[populora] ", 1)[1]
    rows = [ln for ln in summary if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 15 and rows[0].startswith("| 1 | 60.0 |")
    steady = next(ln for ln in summary if ln.startswith("steady step"))
    assert "median 31.0 s (30.0-31.0, 11 steps)" in steady  # step 1 and the 3 evolution steps left out
    assert next(ln for ln in summary if ln.startswith("evolution:")) == "evolution: 3 events, median 0.80 s, max 0.80 s"
    host = next(ln for ln in summary if ln.startswith("host memory"))
    assert "from step 5 to 15: 105.0 -> 105.5 GB, +0.50 GB per 10 steps" in host, host


def test_the_dry_run_summary_of_a_run_that_stopped_early_says_so():
    from populora_verl.random_model import dry_run_summary

    assert dry_run_summary("Traceback (most recent call last):\n") == (
        "start-up: no line (the run stopped before step 1 ended)\nno step finished")
    two = dry_run_summary(_console_line(1, 60.0, 100.0) + _console_line(2, 30.0, 100.2))
    assert "host memory: growth needs 2 steps from step 5 on" in two and "steady step" in two


def test_the_run_s_own_memory_sums_the_processes_below_it_and_the_summary_reads_it_from_a_saved_log(tmp_path, capsys):
    import subprocess

    from populora_verl.random_model import run_memory_gb

    # a child that holds 256 MiB of written pages (a multiplied bytes object is filled, not left to calloc's zero pages)
    child = subprocess.Popen([sys.executable, "-c", "import sys; x = b'x' * (256 << 20); print('ready', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        alone, n_alone = run_memory_gb(child.pid)
        tree, n_tree = run_memory_gb(os.getpid())
        assert n_alone == 1 and alone >= 0.25
        assert n_tree >= 2 and tree >= alone  # this process and the child below it
    finally:
        child.communicate("")
    assert run_memory_gb(child.pid) is None  # gone

    # the summary from a saved log: the run's own memory grows 0.1 GB a step while the machine's moves with others
    text = STARTUP + "\n" + "".join(
        _console_line(s, 30.0, 100.0 + 3 * (s % 2))
        + f"[populora] dry run: step {s}, the run's processes hold {40 + 0.1 * s:.2f} GB (30 processes, PSS)\n"
        for s in range(1, 12)
    )
    log = tmp_path / "dry-run.log"
    log.write_text("(TaskRunnerV1 pid=7) noise\n" + text)
    assert models.main(["summary", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("| run's own GB |") and out[3].endswith("| 40.1 |")
    own = next(ln for ln in out if ln.startswith("the run's own memory"))
    assert "from step 5 to 11: 40.5 -> 41.1 GB, +1.00 GB per 10 steps (least squares over 7 steps)" in own, own
    assert models.main(["summary", str(tmp_path / "none.log")]) == 2
    assert "log " in capsys.readouterr().err


def test_the_run_s_own_memory_skips_a_process_that_ends_while_it_is_read(monkeypatch):
    """A process without PSS access is read by its resident size; one that ends between the two reads is skipped
    instead of ending the dry run (its trainer keeps starting and ending Ray workers)."""
    import psutil

    from populora_verl.random_model import run_memory_gb

    def no_pss(self):
        raise psutil.AccessDenied(self.pid)

    def gone(self):
        raise psutil.NoSuchProcess(self.pid)

    monkeypatch.setattr(psutil.Process, "memory_full_info", no_pss)
    gb, n = run_memory_gb(os.getpid())
    assert n >= 1 and gb > 0  # resident sizes instead
    monkeypatch.setattr(psutil.Process, "memory_info", gone)
    assert run_memory_gb(os.getpid()) == (0.0, 0)
