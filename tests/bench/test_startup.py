"""The start-up benchmark on CPU: the timeline line's parser, the per-phase table from canned logs, the options,
and each lever's overrides composed with a recipe by hydra. Also the reachable CUDA-graph capture sizes."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from populora_verl.bench import startup
from populora_verl.rollout import capture_sizes as cs
from populora_verl.trainer.timeline import LINE_PREFIX, Timeline, parse_line

from _shared import compose_recipe

RECIPE = "qwen1.5b_1gpu_2t2s"
PHASES = ["ray + task runner", "task runner setup", "workers + vLLM", "checkpoint + weight sync", "agent loop", "step 1"]


def _line(*secs: float) -> str:
    t, at = Timeline(start=0.0), 0.0
    for name, sec in zip(PHASES, secs, strict=True):
        at += sec
        t.mark(name, at=at)
    return t.line()


def test_parse_line_inverts_the_timeline_and_takes_the_last_line():
    log = "\n".join(["noise", _line(40, 50, 300, 10, 1, 100), "(TaskRunner pid=1) " + _line(41, 12, 182, 3, 9, 48)])
    assert parse_line(log) == dict(zip([*PHASES, "total"], [41, 12, 182, 3, 9, 48, 295], strict=True))
    assert parse_line("no line here") is None
    assert parse_line(LINE_PREFIX + "workers + vLLM 10 s") == {"workers + vLLM": 10.0}  # a shortened line


def test_the_table_from_canned_logs(tmp_path):
    for name, secs in {
        "A-r0": (40, 50, 300, 10, 30, 100),
        "A-r1": (42, 50, 310, 10, 30, 90),
        "A-r2": (44, 50, 290, 10, 30, 95),
        "B-r0": (40, 50, 300, 10, 2, 70),
        "B-r1": (40, 50, 305, 10, 2, 60),
        "B-r2": (40, 50, 295, 10, 2, 65),
    }.items():
        (tmp_path / f"{name}.log").write_text(f"# cmd\nsome output\n{_line(*secs)}\nmore\n")
    (tmp_path / "B-r3.log").write_text("Traceback: died before step 1\n")
    (tmp_path / "results.md").write_text("not a log")
    arms, missing = startup.read_logs(tmp_path)
    assert list(arms) == ["A", "B"] and [len(v) for v in arms.values()] == [3, 3] and missing == ["B-r3.log"]
    stats = startup.summarize(arms["A"])
    assert list(stats)[-1] == "total"
    assert stats["workers + vLLM"] == {"median": 300, "min": 290, "max": 310, "n": 3}
    text = startup.table(arms)
    rows = {r.split(" | ")[0].strip("| "): r for r in text.splitlines()}
    assert "A median (s, 3 runs)" in text and "B - A (s)" in text
    assert rows["agent loop"].endswith("| 30 | 30-30 | 2 | 2-2 | -28 |")
    assert rows["step 1"].endswith("| 95 | 90-100 | 65 | 60-70 | -30 |")
    assert list(rows)[-1] == "total"
    assert startup.main(["--from-logs", str(tmp_path)]) == 0


def test_a_single_arm_table_has_no_difference_column():
    text = startup.table({"base": [parse_line(_line(1, 2, 3, 4, 5, 6))]})
    assert "base median (s, 1 runs)" in text and " - " not in text.splitlines()[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config-name", RECIPE, "--model", "m", "--runs", "0"], "--runs"),
        (["--config-name", "no_such_recipe", "--model", "m"], "no such recipe"),
        (["--config-name", RECIPE], "--model is required"),
        (["--model", "m"], "--config-name is required"),
        (["--config-name", RECIPE, "--model", "m", "--b-override", "a=1"], "needs --lever"),
        (["--config-name", RECIPE, "--model", "m", "--override", "novalue"], "KEY=VALUE"),
        (["--config-name", RECIPE, "--model", "m", "--lever", "not_a_lever"], "invalid choice"),
        (["--config-name", RECIPE, "--model", "m", "--arms", "B"], "--arms needs --lever"),
        (["--config-name", RECIPE, "--model", "m", "--lever", "use_shm", "--arms", "C"], "--arms C"),
        (["--config-name", RECIPE, "--model", "m", "--lever", "use_shm", "--arms", "A,A"], "--arms A,A"),
        (["--config-name", RECIPE, "--model", "m", "--lever", "use_shm", "--first-runs", "0", "--runs", "0"], "--runs"),
    ],
)
def test_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        startup.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_lever_that_cannot_run_for_the_recipe_stops_before_any_run(tmp_path, capsys):
    base = ["--config-name", RECIPE, "--model", "m", "--out", str(tmp_path), "--dry-run"]
    for lever in ("weight_sync", "stack"):
        assert startup.main([*base, "--lever", lever]) == 2
        assert "--b-override" in capsys.readouterr().err
    assert startup.main([*base, "--lever", "capture_sizes"]) == 2  # every size of this recipe is reachable
    assert "changes nothing" in capsys.readouterr().err
    tp2 = ["--override", "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "--override", "trainer.n_gpus_per_node=2"]
    assert startup.main([*base, *tp2, "--lever", "uni_executor"]) == 2  # uni runs one GPU per engine
    assert "tensor_model_parallel_size=2" in capsys.readouterr().err


def test_dry_run_alternates_the_arms(tmp_path, capsys):
    argv = ["--config-name", RECIPE, "--model", "/m", "--out", str(tmp_path), "--dry-run", "--lever"]
    assert startup.main([*argv, "early_agent_loop", "--override", "populora.buffer.seed_programs=0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    arms = ["A" if "populora_early_agent_loop=false" in ln else "B" for ln in lines]
    # one first run of each arm, outside the A/B (B's config may compile anew); then the arms alternate
    assert arms == ["A", "B", "A", "B", "B", "A", "A", "B"]
    assert all("populora.buffer.seed_programs=0" in ln and "actor_rollout_ref.model.path=/m" in ln for ln in lines)
    assert [ln.split("trainer.default_local_dir=")[1].split()[0].rsplit("/", 1)[1] for ln in lines[:4]] == [
        "first-r0",
        "first_B-r0",
        "A-r0",
        "B-r0",
    ]
    assert startup.main([*argv, "early_agent_loop", "--first-runs", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6


def _dir_names(out: str) -> list[str]:
    return [ln.split("trainer.default_local_dir=")[1].split()[0].rsplit("/", 1)[1] for ln in out.splitlines()]


def test_one_arm_per_gpu_runs_that_arms_first_runs_and_rounds_only(tmp_path, capsys):
    argv = ["--config-name", RECIPE, "--model", "/m", "--out", str(tmp_path), "--dry-run", "--lever", "early_agent_loop"]
    assert startup.main([*argv, "--arms", "B", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert _dir_names(out) == ["first_B-r0", "B-r0", "B-r1"]
    assert out.count("populora_early_agent_loop=true") == 3
    assert startup.main([*argv, "--arms", "A", "--first-runs", "0", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert _dir_names(out) == ["A-r0"] and "populora_early_agent_loop=false" in out
    # the cold runs alone, the rounds left to jobs side by side
    assert startup.main([*argv, "--runs", "0"]) == 0
    assert _dir_names(capsys.readouterr().out) == ["first-r0", "first_B-r0"]


@pytest.mark.parametrize(
    "lever", ["early_agent_loop", "early_servers", "early_transfer_queue", "compile_cache", "use_shm", "capture_sizes", "uni_executor", "weight_sync", "stack"]
)
def test_each_levers_overrides_compose_with_a_recipe(lever, tmp_path):
    recipe = "4t4s" if lever == "capture_sizes" else RECIPE  # a recipe with sizes it cannot reach
    config = compose_recipe(recipe)
    b_override = ["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512"]
    arms = {
        arm: compose_recipe(
            recipe,
            [
                *startup.BASE_OVERRIDES,
                *startup.arm_overrides(
                    lever, arm, config, tmp_path, b_override if lever in ("weight_sync", "stack") else ()
                ),
            ],
        )
        for arm in ("A", "B")
    }
    a, b = arms["A"], arms["B"]
    env = "ray_kwargs.ray_init.runtime_env.env_vars"
    if lever == "early_agent_loop":
        assert a.trainer.populora_early_agent_loop is False
        assert b.trainer.populora_early_agent_loop is True
    elif lever == "early_servers":
        assert a.trainer.populora_early_servers is False and b.trainer.populora_early_servers is True
        assert config.trainer.populora_early_servers is True  # the recipes' default: B is the recipe as it stands
    elif lever == "early_transfer_queue":
        assert a.trainer.populora_early_transfer_queue is False and b.trainer.populora_early_transfer_queue is True
        assert config.transfer_queue.backend.storage_backend == "SimpleStorage"  # where the lever acts
    elif lever == "compile_cache":
        assert OmegaConf.select(a, f"{env}.VLLM_DISABLE_COMPILE_CACHE") == "1"
        assert OmegaConf.select(b, f"{env}.VLLM_DISABLE_COMPILE_CACHE") == "0"
        assert OmegaConf.select(b, f"{env}.VLLM_CACHE_ROOT") == str(tmp_path / "vllm_cache")
    elif lever == "use_shm":
        assert a.actor_rollout_ref.model.use_shm is False and b.actor_rollout_ref.model.use_shm is True
    elif lever == "capture_sizes":
        assert list(b.actor_rollout_ref.rollout.cudagraph_capture_sizes) == cs.reachable_capture_sizes(config)
        assert OmegaConf.select(a, cs.CAPTURE_KEY) == OmegaConf.select(config, cs.CAPTURE_KEY)
    elif lever == "uni_executor":
        backend = "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend"
        assert OmegaConf.select(a, backend) == "mp" and OmegaConf.select(b, backend) == "uni"
        assert OmegaConf.select(config, backend) == "uni"  # the recipes' default: B is the recipe as it stands
    else:  # B from --b-override; A is the recipe as it stands
        assert b.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 512
        assert a.trainer.populora_early_agent_loop is True
    assert a.trainer.save_freq == -1 and b.trainer.save_freq == -1


# --- reachable capture sizes ---------------------------------------------------------------------------------------


def test_phase_sizes_of_the_one_gpu_recipes():
    from populora_verl.config import load_config

    pop = cs.phase_sequences(load_config(compose_recipe("qwen1.5b_1gpu_2t2s").populora))
    # teachers: 2 x 3 types x 10 proposals; students: 2 x 30 tasks of the teacher met x 5 answers; seeding 64 + 64
    assert (pop.teacher, pop.student, pop.seed, pop.largest) == (60, 300, 128, 300)
    four = cs.phase_sequences(load_config(compose_recipe("qwen1.5b_1gpu_4t4s").populora))
    assert (four.teacher, four.student) == (120, 600)


def test_every_size_of_the_one_gpu_recipes_is_reachable():
    config = compose_recipe("qwen1.5b_1gpu_2t2s")
    assert cs.max_concurrent_sequences(config) == 256  # verl's max_num_seqs caps the 300 answers
    assert cs.reachable_capture_sizes(config) == list(config.actor_rollout_ref.rollout.cudagraph_capture_sizes)
    assert cs.capture_sizes_override(config) is None


def test_sizes_above_the_largest_phase_are_dropped_but_one_covers_it():
    config = compose_recipe(
        "qwen1.5b_1gpu_2t2s",
        ["populora.rollout.student_n=1", "populora.rollout.proposals_per_type=4", "populora.buffer.seed_programs=8"],
    )
    # students 2 x 12 x 1 = 24, teachers 2 x 12 = 24, seeding 16: a replica holds at most 24 sequences
    assert cs.max_concurrent_sequences(config) == 24
    assert cs.reachable_capture_sizes(config) == [1, 2, 4, 8, 16, 24]
    assert cs.reachable_capture_sizes(config, [1, 8, 32, 64]) == [1, 8, 32]  # the first size at or above 24
    assert cs.capture_sizes_override(config) == f"{cs.CAPTURE_KEY}=[1,2,4,8,16,24]"


def test_replicas_split_a_phase_and_max_num_seqs_caps_it():
    config = compose_recipe("4t4s")  # 8 GPUs, TP 1: eight replicas
    from populora_verl.config import load_config

    largest = cs.phase_sequences(load_config(config.populora)).largest
    assert cs.max_concurrent_sequences(config) == -(-largest // 8)
    capped = compose_recipe("4t4s", ["actor_rollout_ref.rollout.max_num_seqs=16"])
    assert cs.max_concurrent_sequences(capped) == 16
    assert cs.reachable_capture_sizes(capped, None)[-1] == 16  # vLLM's own ladder when the recipe gives none


def test_an_eager_engine_captures_nothing_to_limit():
    assert compose_recipe("smoke_0.5b").actor_rollout_ref.rollout.enforce_eager
    assert cs.capture_sizes_override(compose_recipe("smoke_0.5b")) is None


def test_vllms_default_ladder():
    assert cs.vllm_default_capture_sizes(256)[:5] == [1, 2, 4, 8, 16]
    assert cs.vllm_default_capture_sizes(256)[-3:] == [480, 496, 512]
    assert cs.vllm_default_capture_sizes(8) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="positive"):
        cs.reachable_capture_sizes(compose_recipe("4t4s"), [0, 8])


def test_each_run_times_its_start_up_from_its_own_launch(monkeypatch):
    """The benchmark imports the plugin, which records its own start time in the environment; a run that inherited
    it would count every earlier run into its first phase (seen on a GPU: the second run's "ray + task runner" was
    the first run's whole start-up longer)."""
    import subprocess
    import sys

    from populora_verl.trainer.timeline import START_ENV

    monkeypatch.setenv(START_ENV, "1.0")  # as the benchmark's own import left it, long before this run
    env = startup.run_env("B-r1", None)
    assert START_ENV not in env
    child = "from populora_verl.trainer import timeline as t; t.record_start(); print(t.Timeline().marks[0][1])"
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout) > 1.0, "the run's timeline starts at the benchmark's start, not its own"


STEP1 = "(TaskRunnerV1 pid=7) step:1 - timing_s/gen:41.2 - timing_s/update_actor:17.4 - timing_s/old_log_prob:0.1 - x:3"
# what two vLLM engines (one per replica) log of their start at INFO
VLLM_LINES = """(PopuLoRAvLLMHttpServer pid=9) (Worker pid=10) INFO 11-29 01:38:40 [default_loader.py:291] Loading weights took 0.62 seconds
(PopuLoRAvLLMHttpServer pid=9) (Worker pid=10) INFO 11-29 01:38:41 [gpu_model_runner.py:4120] Model loading took 3.4 GiB memory and 1.93 seconds
(PopuLoRAvLLMHttpServer pid=9) (Worker pid=10) INFO 11-29 01:38:59 [monitor.py:34] torch.compile takes 14.20 s in total
(PopuLoRAvLLMHttpServer pid=9) (Worker pid=10) INFO 11-29 01:39:34 [gpu_model_runner.py:5010] Graph capturing finished in 9 secs, took 0.51 GiB
(PopuLoRAvLLMHttpServer pid=9) (EngineCore pid=11) INFO 11-29 01:39:34 [core.py:283] init engine (profile, create kv cache, warmup model) took 41.87 seconds
(PopuLoRAvLLMHttpServer pid=12) (EngineCore pid=13) INFO 11-29 01:39:36 [core.py:283] init engine (profile, create kv cache, warmup model) took 44.10 seconds
"""


def test_the_first_run_stays_out_of_the_ab_and_step_1_is_split_by_verls_timings(tmp_path, capsys):
    for name, secs in {"first-r0": (56, 36, 272, 3, 0, 75), "first_B-r0": (50, 35, 250, 3, 3, 62),
                       "A-r0": (50, 35, 200, 3, 0, 70), "B-r0": (50, 35, 190, 3, 3, 60)}.items():
        (tmp_path / f"{name}.log").write_text(f"# cmd\n{_line(*secs)}\n{STEP1}\n")
    arms, missing = startup.read_logs(tmp_path)
    assert list(arms) == ["first", "first_B", "A", "B"] and not missing
    other = tmp_path / "gpu1"  # the arms swapped on a second GPU: its logs add a run to each arm
    other.mkdir()
    for name, secs in {"A-r0": (52, 35, 210, 3, 0, 72), "B-r0": (50, 35, 192, 3, 3, 58)}.items():
        (other / f"{name}.log").write_text(f"# cmd\n{_line(*secs)}\n{STEP1}\n")
    (other / "B-r1.log").write_text("died\n")
    both, missing = startup.read_logs(tmp_path, other)
    assert [len(both[a]) for a in ("first", "A", "B")] == [1, 2, 2] and missing == [str(other / "B-r1.log")]
    assert startup.main(["--from-logs", str(tmp_path), str(other)]) == 0
    assert "A median (s, 2 runs)" in capsys.readouterr().out
    assert arms["A"][0]["step 1: gen"] == 41.2 and arms["A"][0]["step 1: update_actor"] == 17.4
    assert "step 1: populora_score" not in arms["A"][0]  # only what verl's line has
    assert "vLLM: init engine" not in arms["A"][0]  # a log without vLLM's INFO lines
    text = startup.table(arms)
    rows = {r.split(" | ")[0].strip("| "): r for r in text.splitlines()}
    assert "B - A (s)" in text and "first median (s, 1 runs)" in text
    assert rows["workers + vLLM"].endswith("| 272 | 272-272 | 250 | 250-250 | 200 | 200-200 | 190 | 190-190 | -10 |")
    assert list(rows)[-1] == "total" and "step 1: gen" in rows


def test_a_run_ends_once_it_printed_its_start_up_line_and_step_1(tmp_path):
    """A stand-in trainer that prints both lines and would then run on: the run is ended, its phases read."""
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(f"import time\nprint({_line(40, 50, 300, 10, 2, 60)!r})\nprint({STEP1!r}, flush=True)\n"
                      "time.sleep(3600)\n")
    cmd = [sys.executable, str(script), f"trainer.default_local_dir={tmp_path / 'run'}"]
    phases = startup.run_once(cmd, tmp_path / "A-r0.log", startup.run_env("A-r0", None), timeout_s=600)
    assert phases["total"] == 462 and phases["step 1: gen"] == 41.2
    assert (tmp_path / "run" / "STOP").exists()


def test_vllms_own_start_up_reports_are_read_the_slowest_engine_counts(monkeypatch):
    phases = startup.log_phases(f"# cmd\n{VLLM_LINES}{_line(56, 36, 164, 3, 3, 64)}\n{STEP1}\n")
    assert {k: v for k, v in phases.items() if k.startswith("vLLM")} == {
        "vLLM: loading weights": 0.62, "vLLM: model loading": 1.93, "vLLM: torch.compile": 14.2,
        "vLLM: CUDA graphs": 9.0, "vLLM: init engine": 44.1}
    assert list(startup.summarize([phases]))[-1] == "total"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert startup.run_env("A-r0", None)["VLLM_LOGGING_LEVEL"] == "INFO"  # what makes vLLM print them
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert startup.run_env("A-r0", None)["VLLM_LOGGING_LEVEL"] == "DEBUG"  # a user's own level is kept
