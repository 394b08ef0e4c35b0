"""The step-scaling and ceiling benchmarks' logic (their runs need a GPU): parsing, statistics, plumbing, status."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from populora_verl.bench import ceiling as cl
from populora_verl.bench import step_scaling as ss


def _row(step, **data):
    return {"step": step, "data": data}


def test_console_parsing_and_refusal_without_cuda(capsys):
    steps, peak, _ = ss.summarize(ss.console_rows("noise\nstep:1 - timing_s/step:12.5 - perf/max_memory_allocated_gb:3.2\n"
                                                  "step:2 - timing_s/step:10.0 - perf/max_memory_allocated_gb:3.5 - x:nan\n"))
    assert steps == {1: 12.5, 2: 10.0} and peak == 3.5
    # on a real run verl's console lines sit behind Ray's actor prefix
    steps, peak, _ = ss.summarize(ss.console_rows(
        "\x1b[36m(TaskRunnerV1 pid=7)\x1b[0m step:2 - timing_s/step:54.0 - actor/perf/max_memory_allocated_gb:4.0\n"))
    assert steps == {2: 54.0} and peak == 4.0
    if not torch.cuda.is_available():
        assert ss.main(["--model", "m=/m"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_file_logger_first_with_warmup_spread_and_tokens(tmp_path):
    rows = [_row(1, **{"timing_s/step": 90.0, "timing_s/gen": 80.0, "perf/max_memory_allocated_gb": 2.0}),
            _row(2, **{"timing_s/step": 10.0, "timing_s/gen": 6.0, "timing_s/update_actor": 3.0,
                       "populora/rollout/teacher/response_tokens": 2048, "populora/rollout/student/response_tokens": 4096,
                       "populora/rollout/teacher/sequences": 2, "populora/rollout/student/sequences": 4,
                       "populora/rollout/teacher/prompt_tokens": 600, "populora/rollout/student/prompt_tokens": 800}),
            _row(3, **{"timing_s/step": 12.0, "timing_s/gen": 8.0, "actor/perf/max_memory_allocated_gb": 2.5,
                       "populora/s0/actor/perf/max_memory_allocated_gb": 2.25,
                       # no counters of ours: verl's means over the trained batch (2 sequences of 100 + 1000)
                       "response_length/mean": 1000.0, "prompt_length/mean": 100.0, "perf/total_num_tokens": 2200,
                       "perf/mfu/actor": 0.25, "training/rollout_probs_diff_mean": 0.02,
                       "populora/all/training/rollout_probs_diff_mean": 0.01})]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 4, "da'  # a killed run's torn last line
    (tmp_path / "2t2s.metrics.jsonl").write_text(text)
    (tmp_path / "2t2s.log").write_text("step:2 - timing_s/step:999.0\n")  # fallback only
    fig = ss.read_results(tmp_path, "2t2s")
    assert fig.step_s == {1: 90.0, 2: 10.0, 3: 12.0} and fig.peak_gb == 2.5
    assert fig.phases_s == {"gen": 7.0, "update_actor": 3.0}  # step 1 (warm-up) excluded
    assert fig.gen_tokens == pytest.approx((6144 + 2000) / 2)
    assert fig.rollout["teacher"] == {"sequences": 2, "prompt_tokens": 600, "response_tokens": 2048}
    assert fig.mfu == 0.25 and fig.trained_tokens == 2200  # only step 3 logged them
    assert fig.probs_diff == 0.01  # over all adapters, where the trainer logs it
    (tmp_path / "single.log").write_text("(TaskRunnerV1 pid=7) step:2 - timing_s/step:5.0\n")
    assert ss.read_results(tmp_path, "single").step_s == {2: 5.0}

    r = ss.RunResult("2t2s", 4, 0, 1.0, fig.step_s, fig.peak_gb, 1000.0, fig.phases_s, startup_s=61.0,
                     gen_tokens=fig.gen_tokens, rollout=fig.rollout, ceiling_tok_s=2000.0)
    assert r.mean_step_s == 11.0 and r.std_step_s == pytest.approx(2 ** 0.5)
    assert r.gen_tok_s == pytest.approx(4072 / 7.0)
    table = ss.report([ss.RunResult("single", 1, 0, 1.0, {2: 5.0}, 1.0, 1000.0, {"gen": 4.0}), r])
    assert "| 2t2s | 4 | 11.0 | 1.4 | 10.0-12.0 | 2 | 2.20 | 2.8 | 61 | 90.0 | 1000 | 1.00 | 2.50 | 0 |" in table
    assert "| config | gen s | update_actor s |" in table and "| 2t2s | 7.0 | 3.0 |" in table
    assert "| 2t2s | 2 | 4 | 4072 | 7.0 | 582 | 2000 | 0.29 |" in table
    # the proposal validation (sandboxed execution) nested in verl's gen timer is not generation
    # trained tokens per second of the whole step, against the single agent's: the population's throughput ratio
    single = ss.RunResult("single", 1, 0, 1.0, {1: 9.0, 2: 10.0}, mfu=0.2, trained_tokens=1000.0)
    pop = ss.RunResult("4t4s", 8, 0, 1.0, {1: 9.0, 2: 25.0}, mfu=0.3, trained_tokens=4000.0, probs_diff=0.0123)
    assert single.trained_tok_s == 100.0 and pop.trained_tok_s == 160.0
    assert "| 4t4s | 4000 | 160 | 1.60 | 0.300 | 0.0123 |" in ss.report([single, pop])
    assert ss.RunResult("x", 1, 0, 0.0, {1: 9.0}).trained_tok_s is None  # no measured step
    v = ss.RunResult("x", 1, 0, 0.0, phases_s={"gen": 8.0, "populora_validate": 2.0}, gen_tokens=600.0)
    assert v.gen_s == 6.0 and v.gen_tok_s == 100.0
    # warm-up of 2 leaves one step
    assert ss.RunResult("x", 1, 0, 0.0, {1: 9.0, 2: 9.0, 3: 4.0}, warmup=2).steady == [4.0]


def test_command_profiles_and_model_tags():
    extra = ss.plan_overrides("fast", 1024, True)
    assert "actor_rollout_ref.rollout.enforce_eager=false" in extra
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=false" in extra
    assert "++trainer.populora_fused_rpc=true" in extra
    assert "data.max_response_length=1024" in extra and "actor_rollout_ref.rollout.ignore_eos=true" in extra
    assert "populora.buffer.seed_programs=0" in extra  # a one-off phase, not a step cost
    assert "++trainer.populora_fused_rpc=false" in ss.plan_overrides("baseline", None, False)
    assert not any("ignore_eos" in x or "max_response_length" in x for x in ss.plan_overrides("baseline", 0, False))
    with pytest.raises(ValueError):
        ss.plan_overrides("turbo", None, False)
    cmd = ss.command("/m", "8t8s", 3, Path("/tmp/o"), extra)
    assert "populora.population.num_teachers=8" in cmd and "trainer.total_training_steps=3" in cmd
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras=16" in cmd
    assert "trainer.logger=[console,file]" in cmd and cmd[-len(extra):] == extra
    assert ss.parse_models(["1.5b=/a/b:single,4t4s+8t8s", "/x/qwen-0.5b:single,2t2s"], ["single", "4t4s"]) == [
        ("1.5b", "/a/b", ["single", "4t4s"], ["8t8s"]), ("qwen-0.5b", "/x/qwen-0.5b", ["single", "2t2s"], [])]
    assert ss.parse_models(["m=/p"], ["single"]) == [("m", "/p", ["single"], [])]
    for bad in (["a=/x", "a=/y"], ["bad tag=/x"], ["a="], ["a=/x:9t9s"], ["a=/x"], ["a=/x:single+single"]):
        with pytest.raises(ValueError):
            ss.parse_models(bad, [] if bad == ["a=/x"] else ["single"])


def test_recipe_composes_with_every_config_and_profile():
    """Every key the bench overrides exists in verl's schema (hydra would fail on the GPU otherwise)."""
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    from populora_verl.config import load_config
    from populora_verl.trainer import verl_config

    with initialize_config_dir(config_dir=str(ss.RECIPES), version_base=None):
        for name, profile in [(n, "fast") for n in ss.CONFIGS] + [("4t4s", "baseline"), ("2t2s", "varlen"),
                                                                   ("4t4s", "fused"), ("4t4s", "varlen_wide"),
                                                                   ("single", "verl_logprobs"),
                                                                   ("single", "varlen_wide_keep"),
                                                                   ("4t4s", "varlen_wide_keep_liger"),
                                                                   ("4t4s", "varlen_wide_keep_uni"),
                                                                   ("single", "varlen_wide_peft"),
                                                                   ("4t4s", "varlen_wide_liger_fused"),
                                                                   ("4t4s", "varlen_nocompile"),
                                                                   ("8t8s", "varlen_wide_keep_liger_nocompile"),
                                                                   ("4t4s", "varlen_wide_keep_liger_resident"),
                                                                   ("8t8s", "varlen_wide_keep_liger_resident_verlmb")]:
            cmd = ss.command("/m", name, 6, Path("/tmp/o"), ss.plan_overrides(profile, 1024, True))
            overrides = cmd[cmd.index("smoke_0.5b") + 1:]
            cfg = compose(config_name="smoke_0.5b", overrides=overrides)
            pcfg = load_config(cfg.populora)
            verl_config.validate_verl_config(cfg, pcfg)
            assert pcfg.population.num_adapters == ss.ADAPTERS[name]
            assert cfg.data.max_response_length == 1024 and cfg.actor_rollout_ref.rollout.ignore_eos
            assert pcfg.buffer.seed_programs == 0
            assert pcfg.population.adapter_layout == ("resident" if "_resident" in profile else "bank")
            if profile == "fast":
                assert cfg.actor_rollout_ref.rollout.enforce_eager is False
                assert list(cfg.actor_rollout_ref.rollout.cudagraph_capture_sizes) == ss.CUDAGRAPH_SIZES
                assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False
                assert cfg.trainer.populora_fused_rpc is True
            if profile == "fused":
                assert cfg.actor_rollout_ref.model.use_fused_kernels is True
                assert cfg.actor_rollout_ref.model.fused_kernel_options.impl_backend == "torch"
            keep = profile.startswith("varlen_wide_keep")
            assert cfg.actor_rollout_ref.actor.fsdp_config.reshard_after_forward is (not keep)
            assert cfg.actor_rollout_ref.model.use_liger is ("liger" in profile)
            fused_adam = (cfg.actor_rollout_ref.actor.optim.override_optimizer_config or {}).get("fused")
            assert fused_adam is (True if profile.endswith("_fused") else None)
            # verl hands engine_kwargs.vllm to vLLM after its own "mp", so ours wins; the recipes set uni themselves
            assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.get("distributed_executor_backend") == "uni"
            env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
            assert {k: env[k] for k in ss.PROFILE_ENV.get(profile, {})} == ss.PROFILE_ENV.get(profile, {})
            lean = profile in ("varlen_wide_keep_liger", "varlen_wide_keep_uni", "varlen_wide_keep_liger_nocompile",
                               "varlen_wide_keep_liger_resident", "varlen_wide_keep_liger_resident_verlmb")
            assert env.get("POPULORA_RESIDENT_MICRO_BATCHES") == ("verl" if profile.endswith("_verlmb") else None)
            assert env.get("POPULORA_LORA_FORWARD") == (
                "lean" if lean else "peft" if profile in ("varlen_wide_peft", "baseline") else None)
            vllm = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm
            if profile.endswith("_nocompile"):  # verl's vLLM server json-decodes a string and keeps our graph mode
                assert json.loads(vllm.compilation_config) == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
                assert cfg.actor_rollout_ref.rollout.enforce_eager is False  # CUDA graphs stay on
            else:
                assert vllm.get("compilation_config") is None  # verl's default: vLLM's compile pass
            if profile not in ("fast", "baseline"):
                assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "populora_varlen"
                assert cfg.actor_rollout_ref.model.use_remove_padding is True
            if profile.startswith("varlen_wide"):  # the recipe's 8,192 is overridden for training and log-probs
                assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 16384
                assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 32768
            else:
                assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 8192


def test_ceiling_spec_from_measured_rollouts():
    roll = {"teacher": {"sequences": 24, "prompt_tokens": 24 * 310, "response_tokens": 24 * 700},
            "student": {"sequences": 48, "prompt_tokens": 48 * 420, "response_tokens": 48 * 1024}}
    rs = [ss.RunResult("4t4s", 8, 0, 1.0, rollout=roll), ss.RunResult("single", 1, 0, 1.0, rollout={}),
          ss.RunResult("single", 1, 0, 1.0, rollout={"teacher": {"sequences": 6, "prompt_tokens": 600,
                                                                 "response_tokens": 600}})]
    spec = ss.ceiling_spec(rs, 1024, force_length=True)
    assert spec["4t4s"] == {"adapters": 8, "phases": [
        {"phase": "teacher", "requests": 24, "prompt_tokens": 310, "answer_tokens": 1024, "loras": 4},
        {"phase": "student", "requests": 48, "prompt_tokens": 420, "answer_tokens": 1024, "loras": 4}]}
    assert spec["single"]["phases"] == [{"phase": "teacher", "requests": 6, "prompt_tokens": 100,
                                         "answer_tokens": 1024, "loras": 1, "first_lora": 0}]
    assert cl.adapters_needed(spec) == 8
    natural = ss.ceiling_spec(rs[:1], 1024, force_length=False)
    assert [p["answer_tokens"] for p in natural["4t4s"]["phases"]] == [700, 1024]
    ss.attach_ceiling(rs, {"configs": {"4t4s": {"tok_s": 5000.0}}})
    assert rs[0].ceiling_tok_s == 5000.0 and rs[1].ceiling_tok_s is None


def test_results_persist_and_status_reports_progress(tmp_path):
    out = tmp_path / "1.5b"
    out.mkdir()
    rows = [ss.RunResult("4t4s", 8, 0, 300.0, {1: 50.0, 2: 12.0, 3: 14.0}, startup_s=100.0),
            ss.RunResult("single", 1, 0, 250.0, {1: 40.0, 2: 10.0, 3: 10.0})]
    table = ss.save_results(out, rows)
    assert table.index("| single |") < table.index("| 4t4s |")  # sorted in CONFIGS order
    back = ss.load_results(out, keep=["single"])
    assert [r.name for r in back] == ["4t4s"] and back[0].step_s == {1: 50.0, 2: 12.0, 3: 14.0}
    assert back[0].startup_s == 100.0
    (out / "2t2s.metrics.jsonl").write_text(json.dumps(_row(1, **{"timing_s/step": 33.3})) + "\n")
    (out / "2t2s.log").write_text("ok\nRuntimeError: CUDA out of memory\n")
    ss.write_progress(tmp_path, pid=os.getpid(), state="running", started=0.0, plan=["1.5b/single", "1.5b/2t2s"],
                      done=["1.5b/single"])
    ss.write_progress(tmp_path, current={"model": "1.5b", "config": "2t2s", "since": 0.0, "steps": 6})
    text = ss.status(tmp_path)
    assert "running; state running" in text and "now: 1.5b/2t2s" in text and "steps done 1/6: [33.3]" in text
    assert "CUDA out of memory" in text and "## 1.5b" in text and "| 4t4s | 8 | 13.0 |" in text
    assert "no run under" in ss.status(tmp_path / "nothing")
    assert ss.main(["--status", "--out", str(tmp_path)]) == 0


def test_rollout_counts_from_tags_and_lengths():
    pytest.importorskip("transfer_queue")
    from populora_verl.trainer.generation import rollout_counts

    got = rollout_counts([{"prompt_len": 10}, {"prompt_len": "7"}, {}, None, {"prompt_len": "x"}],
                         {"a": 5, "b": 6, "c": 0, "d": 1, "e": 2})
    assert got == {"sequences": 5.0, "prompt_tokens": 17.0, "response_tokens": 14.0}


# --- ceiling ---------------------------------------------------------------------------------------------------------

QWEN_1_5B = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
             "num_hidden_layers": 28}


def test_lora_shapes_match_peft_on_a_qwen2_model(tmp_path):
    """Our shape rule names exactly the modules PEFT's all-linear wraps, with their shapes (tiny Qwen2)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                   num_hidden_layers=2, vocab_size=128)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(cfg),
                                peft.LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
    want = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            mod = name.split("base_model.model.", 1)[1].split(".lora_A.")[0]
            want[mod] = (p.shape[1], None)
        if ".lora_B." in name:
            mod = name.split("base_model.model.", 1)[1].split(".lora_B.")[0]
            want[mod] = (want[mod][0], p.shape[0])
    assert cl.lora_shapes(cfg.to_dict()) == want
    shapes = cl.lora_shapes(QWEN_1_5B)
    assert len(shapes) == 28 * 7 and shapes["model.layers.3.self_attn.k_proj"] == (1536, 256)
    assert shapes["model.layers.27.mlp.down_proj"] == (8960, 1536)
    with pytest.raises(ValueError, match="no shape rule"):
        cl.lora_shapes(QWEN_1_5B, ["lm_head"])


def test_random_adapters_are_loadable_peft_folders(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.Qwen2Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
                                   num_hidden_layers=1, vocab_size=64)
    model_dir = tmp_path / "m"
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    dirs = cl.write_random_adapters(model_dir, tmp_path / "ad", 2, rank=4, alpha=8)
    assert [d.name for d in dirs] == ["adapter_0", "adapter_1"]
    loaded = peft.PeftModel.from_pretrained(transformers.Qwen2ForCausalLM(cfg), str(dirs[1]))
    b = [p for n, p in loaded.named_parameters() if ".lora_B." in n]
    assert b and all(p.abs().sum() > 0 for p in b)  # non-zero: the LoRA path really changes the output
    from safetensors.torch import load_file

    t0, t1 = load_file(str(dirs[0] / "adapter_model.safetensors")), load_file(str(dirs[1] / "adapter_model.safetensors"))
    assert t0.keys() == t1.keys() and any(not torch.equal(t0[k], t1[k]) for k in t0)


def test_plan_requests_and_spec_validation(tmp_path):
    phases = [{"requests": 5, "prompt_tokens": 7, "answer_tokens": 9, "loras": 2},
              {"requests": 3, "prompt_tokens": 4, "answer_tokens": 6, "loras": 3}]
    plan = cl.plan_requests(phases, vocab=1000, seed=1)
    assert [len(p) for p in plan] == [5, 3]
    assert [k for _, k, _ in plan[0]] == [0, 1, 0, 1, 0] and [k for _, k, _ in plan[1]] == [2, 3, 4]
    assert all(len(ids) == 7 and a == 9 for ids, _, a in plan[0]) and all(100 <= i < 999 for i in plan[0][0][0])
    assert plan == cl.plan_requests(phases, vocab=1000, seed=1)
    shared = [dict(p, first_lora=0) for p in phases]  # the single agent: one adapter for both phases
    assert [k for _, k, _ in cl.plan_requests(shared, 1000)[1]] == [0, 1, 2]
    assert cl.adapters_needed({"a": {"phases": phases}, "b": {"phases": shared}}) == 5
    good = tmp_path / "s.json"
    good.write_text(json.dumps({"4t4s": {"adapters": 8, "phases": phases}}))
    assert cl.load_spec(good)["4t4s"]["phases"][1]["loras"] == 3
    for bad in ({}, {"x": {"phases": []}}, {"x": {"phases": [dict(phases[0], requests=0)]}}):
        good.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            cl.load_spec(good)
    if not torch.cuda.is_available():
        assert cl.main(["--model", str(tmp_path)]) == 2


# --- one trainer process for all configurations (population schedule) -----------------------------------------------


def test_schedule_parsing_and_step_mapping():
    from populora_verl.config import ConfigError
    from populora_verl.trainer import schedule as sc

    raw = json.dumps([{"name": "single", "steps": 2, "population": {"mode": "single_agent"}},
                      {"name": "4t4s", "steps": 3, "population": {"num_teachers": 4, "num_students": 4}}])
    entries = sc.parse_schedule(raw, total_steps=5)
    assert [(e.name, e.steps) for e in entries] == [("single", 2), ("4t4s", 3)]
    assert sc.starts(entries) == {1: 0, 3: 1}
    assert [sc.entry_at(entries, g) for g in (1, 2, 3, 5, 6)] == [(0, 1), (0, 2), (1, 1), (1, 3), None]
    assert sc.parse_schedule(None) == [] and sc.parse_schedule("") == []
    for bad, total in (("{", None), ("[]x", None), ('[{"steps": 0}]', None), ('[{"steps": 2}]', 3),
                       ('[{"name": "a", "steps": 1}, {"name": "a", "steps": 1}]', None), ('[{"steps": 1, "population": 3}]', None),
                       ('{"steps": 1}', None)):
        with pytest.raises(ConfigError, match="trainer.populora_population_schedule"):
            sc.parse_schedule(bad, total)


def test_schedule_command_composes_and_the_trainer_reads_it(tmp_path):
    """The JSON survives hydra's override grammar, and the trainer validates every entry at start-up."""
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from populora_verl.trainer import schedule as sc

    names = ["single", "8t8s", "1t1s"]
    (tmp_path / "config.json").write_text("{}")
    cmd = ss.schedule_command(str(tmp_path), names, 6, Path("/tmp/o"), ss.plan_overrides("fast", 1024, True))
    with initialize_config_dir(config_dir=str(ss.RECIPES), version_base=None):
        cfg = compose(config_name="smoke_0.5b", overrides=cmd[cmd.index("smoke_0.5b") + 1:])
    assert cfg.trainer.total_training_steps == 18 and cfg.trainer.default_local_dir == "/tmp/o/schedule/ckpt"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras == 16  # sized for 8t8s from the start
    assert cfg.populora.population.mode == "single_agent"
    entries, pcfgs = sc.scheduled_configs(cfg)
    assert [e.name for e in entries] == names
    assert [p.population.num_adapters for p in pcfgs] == [1, 16, 2]
    assert pcfgs[1].population.mode == "population" and pcfgs[0].population.mode == "single_agent"
    from populora_verl.config import ConfigError
    from populora_verl.startup import preflight

    preflight(cfg, check_gpus=False)
    with open_dict(cfg):  # 8t8s needs vLLM to hold 16 adapters: the entry is refused before Ray starts
        cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras = 8
    with pytest.raises(ConfigError, match="entry '8t8s'"):
        preflight(cfg, check_gpus=False)
    with pytest.raises(ValueError, match="no population"):
        ss.population_of("big")


def test_trainer_switches_population_bank_and_adapters_at_an_entry_start(monkeypatch, bare_trainer):
    pytest.importorskip("transfer_queue")
    from hydra import compose, initialize_config_dir

    from populora_verl.config import load_config
    from populora_verl.trainer import schedule as sc

    names = ["single", "2t2s"]
    cmd = ss.schedule_command("/m", names, 2, Path("/tmp/o"), [])
    with initialize_config_dir(config_dir=str(ss.RECIPES), version_base=None):
        cfg = compose(config_name="smoke_0.5b", overrides=cmd[cmd.index("smoke_0.5b") + 1:])
    schedule, schedule_cfgs = sc.scheduled_configs(cfg)
    t = bare_trainer(cfg, debug_probes=False, timing_raw={}, _schedule=schedule, _schedule_cfgs=schedule_cfgs,
                     pcfg=schedule_cfgs[0])
    calls = []

    class _Step:
        def __init__(self, pcfg, executor=None):
            self.cfg, self.tasks = pcfg, type("T", (), {"executor": executor or "pool"})()
            self.seeded = True  # seed_programs=0 (the bench's setting): nothing to seed
            self.population = type("P", (), {"members": [None] * pcfg.population.num_adapters})()

    monkeypatch.setattr("populora_verl.step.PopulationStep", _Step)
    t.pop_step = _Step(t.pcfg)
    t.checkpoint_manager = type("CM", (), {"sleep_replicas": lambda self: calls.append("sleep"),
                                           "update_weights": lambda self, s: calls.append(("push", s))})()
    t._rpc = lambda name, *a, **k: calls.append((name, *a)) or {"num_slots": a[0]}
    for step in (1, 2):
        t.global_steps = step
        t.on_step_begin()
    assert calls == [] and t.pcfg.population.num_adapters == 1  # entry 0 is set up by init, not switched
    t.global_steps = 3
    t.on_step_begin()
    assert calls == ["sleep", ("populora_init_bank", 4, t.pcfg.population.seed), ("push", 3)]
    assert t.pcfg.population.num_adapters == 4 and len(t.pop_step.population.members) == 4
    assert t.pop_step.tasks.executor == "pool"  # the executor is shared, not leaked
    assert "populora_switch" in t.timing_raw
    assert load_config(cfg.populora).population.num_adapters == 1  # the run's own config is untouched


def test_split_schedule_per_configuration():
    rows = []
    for g in range(1, 7):
        d = {"timing_s/step": 10.0 + g, "timing_s/gen": 5.0, "actor/perf/max_memory_allocated_gb": float(g)}
        if g == 4:
            d["timing_s/populora_switch"] = 7.5
        rows.append((g, d))
    poller = ss.GpuMemoryPoller()
    poller.row_t = {g: 100.0 + 20 * g for g in range(1, 7)}
    poller.samples = [(110.0, 500.0), (150.0, 900.0), (170.0, 700.0), (190.0, 800.0)]
    got = ss.split_schedule(rows, ["single", "4t4s"], 3, 1, poller, t0=50.0)
    assert [r.name for r in got] == ["single", "4t4s"] and all(r.rc == 0 for r in got)
    assert got[0].step_s == {1: 11.0, 2: 12.0, 3: 13.0} and got[1].step_s == {1: 14.0, 2: 15.0, 3: 16.0}
    assert got[0].startup_s == pytest.approx(120.0 - 50.0 - 11.0) and got[1].startup_s == 7.5
    assert got[0].verl_peak_gb == 3.0 and got[1].verl_peak_gb == 6.0
    assert got[0].smi_peak_mib == 900.0 and got[1].smi_peak_mib == 800.0  # windows (t0,160] and [160,220]
    assert got[1].mean_step_s == 15.5
    partial = ss.split_schedule(rows[:4], ["single", "4t4s"], 3, 1, None, t0=0.0)
    assert [r.rc for r in partial] == [0, 1]  # 4t4s logged one step of three: rerun it on its own


FAKE_TRAINER = r'''
import json, os, sys, time
args, path = sys.argv[1:], os.environ["VERL_FILE_LOGGER_PATH"]
steps = int(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.total_training_steps=")))
sched = any("populora_population_schedule" in a for a in args)
time.sleep(0.3)  # "start-up"
with open(path, "w") as f:
    for g in range(1, steps + 1):
        if sched and g > steps // 2:  # the schedule dies at its first switch
            sys.exit(1)
        data = {"timing_s/step": 1.0 + g / 10, "timing_s/gen": 0.5,
                "populora/rollout/teacher/response_tokens": 100, "populora/rollout/student/response_tokens": 300,
                "populora/rollout/teacher/sequences": 2, "populora/rollout/student/sequences": 4,
                "populora/rollout/teacher/prompt_tokens": 20, "populora/rollout/student/prompt_tokens": 40}
        f.write(json.dumps({"step": g, "data": data}) + "\n")
        f.flush()
'''


def test_main_runs_a_schedule_and_reruns_what_it_did_not_finish(tmp_path, monkeypatch):
    """The driver end to end with a stand-in trainer: the schedule finishes its first configuration and dies at the
    switch; the second configuration is rerun in a process of its own; both rows land with their figures."""
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    real_command = ss.command

    def fake_command(model, name, steps, out_dir, extra):
        return [sys.executable, str(script), *real_command(model, name, steps, out_dir, extra)[5:]]

    monkeypatch.setattr(ss, "command", fake_command)
    monkeypatch.setattr(ss, "_has_cuda", lambda: True)
    out = tmp_path / "run"
    ceilings = []
    monkeypatch.setattr(ss, "run_ceiling", lambda path, o, results, *a: ceilings.append(sorted(r.name for r in results))
                        or 0)
    rc = ss.main(["--model", f"m={tmp_path}:single,2t2s+1t1s", "--model", f"n={tmp_path}:single", "--steps", "3",
                  "--out", str(out)])
    assert rc == 0
    # the optional configuration runs after every model's main rows and ceiling
    assert ceilings == [["2t2s", "single"], ["single"]]
    assert json.loads((out / "progress.json").read_text())["done"][-1] == "m/1t1s"
    rows = {r["name"]: r for r in json.loads((out / "m" / "results.json").read_text())}
    assert set(rows) == {"single", "2t2s", "1t1s"} and all(r["rc"] == 0 for r in rows.values())
    assert rows["single"]["step_s"] == {"1": 1.1, "2": 1.2, "3": 1.3}  # from the schedule's first entry
    assert (out / "m" / "2t2s.metrics.jsonl").exists()  # rerun on its own
    assert rows["2t2s"]["startup_s"] is not None and rows["2t2s"]["gen_tokens"] == 400
    assert rows["2t2s"]["rollout"]["student"]["sequences"] == 4
    progress = json.loads((out / "progress.json").read_text())
    assert progress["state"] == "finished" and progress["done"] == ["m/single", "m/2t2s", "n/single", "m/1t1s"]
    assert "| 2t2s | 4 |" in (out / "m" / "results.md").read_text()
    assert "state finished" in ss.status(out)


def test_profile_steps_compose_into_verls_profiler_config(tmp_path):
    """--profile-steps turns on verl's own torch profiler for those steps, on the actor's rank 0."""
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    assert ss.profiler_overrides("", tmp_path) == []
    for bad in ("x", "0", ","):
        with pytest.raises(ValueError, match="--profile-steps"):
            ss.profiler_overrides(bad, tmp_path)
    extra = ss.plan_overrides("fast", 1024, True) + ss.profiler_overrides("9,3", tmp_path / "profile")
    cmd = ss.command("/m", "4t4s", 6, Path("/tmp/o"), extra)
    with initialize_config_dir(config_dir=str(ss.RECIPES), version_base=None):
        cfg = compose(config_name="smoke_0.5b", overrides=cmd[cmd.index("smoke_0.5b") + 1:])
    assert cfg.global_profiler.tool == "torch" and list(cfg.global_profiler.steps) == [3, 9]
    prof = cfg.actor_rollout_ref.actor.profiler
    assert prof.enable is True and list(prof.ranks) == [0]
    assert prof.tool == "torch" and prof.save_path == str(tmp_path / "profile")  # inherited from global_profiler


@pytest.mark.parametrize("profile,expect", [("verl_logprobs", "verl"), ("baseline", "verl"), ("varlen", None)])
def test_a_profiles_environment_reaches_the_trainer_processes(monkeypatch, tmp_path, profile, expect):
    """verl_logprobs (the A/B for our chunked log-probs) differs from varlen only in the environment the trainer
    inherits: POPULORA_LOGPROBS=verl keeps verl's per-token fallback in the workers."""
    # main() sets the profile's variables in os.environ: setenv first so that monkeypatch restores the variable's
    # absence after the test (a delenv of an absent variable records nothing, and the value would leak on).
    monkeypatch.setenv("POPULORA_LOGPROBS", "")
    monkeypatch.delenv("POPULORA_LOGPROBS")
    seen = []

    def fake_run_configs(args, root, tag, path, names, out, results, extra):
        seen.append((os.environ.get("POPULORA_LOGPROBS"), list(extra)))
        return results, True

    monkeypatch.setattr(ss, "_has_cuda", lambda: True)
    monkeypatch.setattr(ss, "_run_configs", fake_run_configs)
    assert ss.main(["--model", "m=/m:single", "--profile", profile, "--no-ceiling", "--out", str(tmp_path)]) == 0
    assert seen and seen[0][0] == expect
    if profile == "verl_logprobs":
        assert seen[0][1][:len(ss._VARLEN)] == ss._VARLEN


def test_failure_excerpt_shows_the_last_traceback_then_error_lines_then_the_tail(tmp_path):
    log = tmp_path / "4t4s.log"
    log.write_text(
        "start\nTraceback (most recent call last):\n  old\nValueError: first\nmore\n"
        "Traceback (most recent call last):\n  File \"w.py\", line 3\nRuntimeError: " + "x" * 400 + "\n"
    )
    got = ss.failure_excerpt(log).splitlines()
    assert got[0] == "  | Traceback (most recent call last):" and "first" not in "".join(got)
    assert got[-1].startswith("  | RuntimeError: x") and len(got[-1]) == len("  | ") + 300
    log.write_text("a\nray.exceptions.ActorDiedError: gone\nb\nc\n")
    assert ss.failure_excerpt(log) == "  | ray.exceptions.ActorDiedError: gone"
    log.write_text("".join(f"line {i}\n" for i in range(9)))
    assert ss.failure_excerpt(log).splitlines() == [f"  | line {i}" for i in range(4, 9)]
    assert "no log" in ss.failure_excerpt(tmp_path / "missing.log")


def test_a_failed_configuration_prints_why_in_the_drivers_output(tmp_path, monkeypatch, capsys):
    import argparse

    def failing_run_one(path, name, steps, out, extra, timeout_s, warmup):
        (out / f"{name}.log").write_text("Traceback (most recent call last):\nRuntimeError: slot kernel failed\n")
        return ss.RunResult(name=name, adapters=8, rc=1, wall_s=3.0)

    monkeypatch.setattr(ss, "run_one", failing_run_one)
    monkeypatch.setattr(ss, "write_progress", lambda *a, **k: None)
    monkeypatch.setattr(ss, "_mark_done", lambda *a, **k: None)
    args = argparse.Namespace(one_process=True, steps=2, timeout_s=10, warmup=1)
    results, ok = ss._run_configs(args, tmp_path, "1.5b", "/m", ["4t4s"], tmp_path, [], [])
    assert not ok and results[0].rc == 1
    assert "  | RuntimeError: slot kernel failed" in capsys.readouterr().out
