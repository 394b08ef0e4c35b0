"""The learning-run driver (populora_verl.bench.learning_run) on CPU: a stand-in trainer per arm that behaves like
ours (seed set, metrics rows, a checkpoint every 2 steps, ends at a safe step once its stop file exists)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from populora_verl.bench import learning_run as lr

FAKE_TRAINER = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    from populora_verl.trainer.stop import due, read_request
    run, seeding = Path(sys.argv[1]), sys.argv[2] == "seed"
    run.mkdir(parents=True, exist_ok=True)
    while not seeding and not Path(sys.argv[2]).exists():
        time.sleep(0.05)
    if seeding:
        time.sleep(0.3)
        (run / "seed_tasks.jsonl").write_text('{"program": "def f(x):\\\\n    return x", "input": "1", "output": "1"}\\n')
    ids = ["t0", "t1", "s0", "s1"] if seeding else ["a0"]
    step = 0
    while step < 200:
        step += 1
        time.sleep(0.05)
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "populora/validity/mean": 0.1, "populora/student/accuracy": 0.5}) + "\\n")
        with open(run / "verl_metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "data": {"timing_s/step": 1.5}}) + "\\n")
        if step % 2 == 0:
            pop = run / f"global_step_{step}" / "populora" / "checkpoints" / f"step_{step}" / "population"
            for i in ids:
                (pop / "adapters" / i).mkdir(parents=True, exist_ok=True)
                (pop / "adapters" / i / "adapter_config.json").write_text("{}")
            (pop / "population.json").write_text(json.dumps({"lineage": [{"id": i, "role": "member"} for i in ids]}))
            if due(read_request(str(run / "STOP")), step, None, None):  # checkpointed steps are the safe ones
                sys.exit(0)
''')


def test_arm_command_uses_the_recipe_model_run_dir_and_shared_seed_set(tmp_path):
    cmd = lr.arm_command("single", "/m", tmp_path, str(tmp_path / "2t2s" / "seed_tasks.jsonl"), ["trainer.x=1"])
    assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"] and cmd[cmd.index("--config-name") + 1] == "qwen1.5b_1gpu_single"
    assert f"trainer.default_local_dir={tmp_path / 'single'}" in cmd and "actor_rollout_ref.model.path=/m" in cmd
    assert f"++populora.buffer.seed_file={tmp_path / '2t2s' / 'seed_tasks.jsonl'}" in cmd and cmd[-1] == "trainer.x=1"
    assert "++populora.buffer.seed_file_wait_s=1800" in cmd
    assert (lr.RECIPES / (lr.ARMS["2t2s"] + ".yaml")).is_file() and (lr.RECIPES / (lr.ARMS["single"] + ".yaml")).is_file()
    env = lr.arm_env("single", tmp_path)
    assert env["RAY_ADDRESS"] == "local" and env["RAY_TMPDIR"] != lr.arm_env("2t2s", tmp_path)["RAY_TMPDIR"]
    warm = lr.warm_cache_command("/bench")
    assert warm[1:4] == ["-m", "populora_verl.eval.cli", "--warm-cache"] and warm[-2:] == ["--data-dir", "/bench"]
    assert warm[warm.index("--benchmarks") + 1] == "humaneval_plus,mbpp_plus"
    with pytest.raises(ValueError, match="unknown arm"):
        lr.arm_command("4t4s_typo", "/m", tmp_path, None, [])


def test_driver_seeds_once_stops_both_arms_and_evaluates_at_the_common_step(tmp_path, monkeypatch, capsys):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    launched = []

    def fake_command(arm, model, root, seed_file, extra):
        launched.append((arm, seed_file))
        # the reusing arm waits for the seed set like the trainer does (buffer.seed_file_wait_s)
        return [sys.executable, str(script), str(root / arm), seed_file or "seed"]

    eval_calls = []

    def fake_eval(model, runs, step, out, *a, **kw):
        eval_calls.append((step, {k: str(v) for k, v in runs.items()}))
        # the real command builder on the fake checkpoints: baseline = the single agent, run dir = the population
        cmd = lr.eval_command.__wrapped__(model, runs, step, out, *a, **kw)
        (out.parent / "real_eval_command.json").write_text(json.dumps(cmd))
        return [sys.executable, "-c", "print('eval ok')"]

    real = lr.eval_command
    fake_eval.__wrapped__ = real
    monkeypatch.setattr(lr, "arm_command", fake_command)
    monkeypatch.setattr(lr, "eval_command", fake_eval)
    warm_marker = tmp_path / "warmed"
    monkeypatch.setattr(lr, "warm_cache_command", lambda data_dir: [
        sys.executable, "-c", f"import pathlib; pathlib.Path({str(warm_marker)!r}).write_text('ok')"])
    monkeypatch.setattr(lr, "POLL_S", 0.05)
    root = tmp_path / "learn"
    rc = lr.main(["--out", str(root), "--model", "/m", "--stop-after-min", "0.02", "--grace-min", "1"])
    assert rc == 0
    # the population arm seeds; the single agent starts alongside and waits for that seed set
    assert launched == [("2t2s", None), ("single", str(root / "2t2s" / "seed_tasks.jsonl"))]
    prog = json.loads((root / "progress.json").read_text())
    assert prog["state"] == "finished" and prog["rcs"] == {"2t2s": 0, "single": 0} and prog["eval_rc"] == 0
    out = capsys.readouterr().out
    assert "2t2s: stop file written" in out and "single: stop file written" in out
    # spent once the arms ended: left behind, a stop file would end a resumed arm at once
    assert not (root / "2t2s" / "STOP").exists() and not (root / "single" / "STOP").exists()
    # both arms ended at an even (checkpointed) step; the eval compares them at the last step both have
    steps = {a: lr.checkpoint_steps(root / a) for a in ("2t2s", "single")}
    common = max(set(steps["2t2s"]) & set(steps["single"]))
    assert prog["common_step"] == common and eval_calls[0][0] == common
    cmd = json.loads((root / "real_eval_command.json").read_text())
    assert cmd[cmd.index("--baseline") + 1].endswith(f"step_{common}/population/adapters/a0")
    assert cmd[cmd.index("--run-dir") + 1].endswith(f"global_step_{common}/populora/checkpoints/step_{common}/population")
    assert cmd[cmd.index("--benchmarks") + 1] == "humaneval_plus,mbpp_plus"
    assert "eval ok" in (root / "eval.log").read_text()
    assert warm_marker.read_text() == "ok"  # the expected-output cache was warmed while the arms trained
    # status names each arm's steps, checkpoints and last metrics
    out = lr.status(root)
    assert "state finished" in out and "2t2s:" in out and "validity/mean=0.1" in out and "step=1.5" in out
    assert re.search(r"2t2s: \d+ steps; checkpoints \[.*\]; last \d+ s ago:", out)  # a stuck arm shows its age
    assert (root / "compare" / "compare.md").is_file()


def test_stop_at_step_ends_every_arm_there(tmp_path, monkeypatch):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(lr, "arm_command", lambda arm, model, root, seed_file, extra: [
        sys.executable, str(script), str(root / arm), seed_file or "seed"])
    monkeypatch.setattr(lr, "POLL_S", 0.05)
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("")
    root = tmp_path / "learn"
    # a given seed set: no arm seeds; the stop file asks for step 6 from the start
    assert lr.main(["--out", str(root), "--model", "/m", "--seed-file", str(seeds), "--stop-at-step", "6",
                    "--stop-after-min", "5", "--no-eval"]) == 0
    assert {a: lr.checkpoint_steps(root / a)[-1] for a in ("2t2s", "single")} == {"2t2s": 6, "single": 6}
    assert not (root / "2t2s" / "seed_tasks.jsonl").exists()


def test_an_arm_failing_at_start_up_stops_the_others(tmp_path, monkeypatch):
    """A config mistake in one arm (here: the single agent exits 2 at once) ends the whole run within a poll, naming
    the arm, instead of training the other arm for a comparison that cannot happen."""
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)

    refusal = "populora: trainer.n_gpus_per_node: 1 GPU(s) requested but no GPU is visible"

    def cmd(arm, model, root, seed_file, extra):
        if arm == "single":  # what a CPU machine answers
            return [sys.executable, "-c", f"import sys; print('ray: noise'); print({refusal!r}); sys.exit(2)"]
        return [sys.executable, str(script), str(root / arm), "seed"]

    monkeypatch.setattr(lr, "arm_command", cmd)
    monkeypatch.setattr(lr, "POLL_S", 0.05)
    monkeypatch.setattr(lr, "warm_cache_command", lambda data_dir: pytest.fail("a cache for a run that never ran"))
    root = tmp_path / "learn"
    assert lr.main(["--out", str(root), "--model", "/m", "--stop-after-min", "5", "--stop-at-step", "100"]) == 1
    prog = json.loads((root / "progress.json").read_text())
    # the reason is the arm's own one line, not only where its log is
    assert prog["state"] == "failed" and prog["reason"] == (
        f"single ended (rc 2) before its first step: {refusal} (whole log: {root / 'single' / 'train.log'})")
    assert not (root / "2t2s" / "STOP").exists() and not (root / "single" / "STOP").exists()
    rows = lr.population_rows(root / "2t2s")
    assert len(rows) < 200  # the population arm was stopped long before its 200 steps


def test_driver_reports_a_seeding_arm_that_dies(tmp_path, monkeypatch):
    monkeypatch.setattr(lr, "arm_command", lambda arm, *a: [sys.executable, "-c", "import sys; sys.exit(3)"])
    monkeypatch.setattr(lr, "POLL_S", 0.05)
    root = tmp_path / "learn"
    assert lr.main(["--out", str(root), "--model", "/m"]) == 1
    prog = json.loads((root / "progress.json").read_text())
    assert prog["state"] == "failed" and "rc 3" in prog["reason"] and "before its first step" in prog["reason"]
    with pytest.raises(SystemExit):
        lr.main(["--out", str(root), "--model", "/m", "--arms", "2t2s,nope"])


def test_seed_file_written_later_is_awaited_at_the_first_step(tmp_path):
    """buffer.seed_file_wait_s: an arm started alongside the seeding arm reads its seed set when it appears."""
    import threading

    from populora_verl.config import BufferConfig
    from populora_verl.tasks import TaskBuffers, save_seed_file
    from populora_verl.tasks.task import Task

    path = tmp_path / "seed_tasks.jsonl"
    bufs = TaskBuffers(BufferConfig(seed_file=str(path), seed_file_wait_s=30))
    assert bufs.pending_seed_file == str(path) and len(bufs["code_o"]) == 0
    seed = Task(type="code_o", program="def f(x):\n    return x * 3", input="2", output="6")
    threading.Timer(0.2, lambda: save_seed_file([seed], path)).start()
    assert bufs.await_seed_file(poll_s=0.05) == 2  # one triplet seeds code_i and code_o
    assert bufs.pending_seed_file is None and len(bufs["code_o"]) == len(bufs["code_i"]) == 1
    assert bufs.await_seed_file() == 0  # nothing pending any more
    late = TaskBuffers(BufferConfig(seed_file=str(tmp_path / "never.jsonl"), seed_file_wait_s=0.1))
    with pytest.raises(FileNotFoundError, match=r"populora\.buffer\.seed_file: .* did not appear within 0\.1 s"):
        late.await_seed_file(poll_s=0.02)
    with pytest.raises(FileNotFoundError):  # no wait configured: a missing seed file fails at once, as before
        TaskBuffers(BufferConfig(seed_file=str(tmp_path / "never.jsonl")))


def test_seeded_arms_run_each_on_its_own_gpu_with_per_kind_overrides(tmp_path, monkeypatch):
    """Two seeds of each arm on a 4-GPU node: each arm has its folder, its seed (population and vLLM sampling), its
    GPU and Ray temp dir, and only its kind's overrides; the evaluation names every arm's members."""
    assert lr.parse_arm("single@2") == ("single", 2) and lr.arm_dir("single@2") == "single-seed2"
    assert lr.arm_dir("2t2s") == "2t2s"
    for bad in ("single@x", "nope@1", "single@-1"):
        with pytest.raises(ValueError):
            lr.parse_arm(bad)
    with pytest.raises(ValueError, match="appear twice"):
        lr.parse_arms("single@1,single@1")
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        lr.arm_overrides(["single=populora.x"])
    cmd = lr.arm_command("2t2s@3", "/m", tmp_path, None, ["a=1"])
    assert f"trainer.default_local_dir={tmp_path / '2t2s-seed3'}" in cmd
    assert "populora.population.seed=3" in cmd and "actor_rollout_ref.rollout.seed=3" in cmd
    env = lr.arm_env("2t2s@3", tmp_path, "2")
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["RAY_TMPDIR"] == "/tmp/ray_2t2s-seed3"
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "2t2s-seed3" / "verl_metrics.jsonl")

    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    seen = {}

    def fake_command(arm, model, root, seed_file, extra):
        seen[arm] = list(extra)
        return [sys.executable, str(script), str(root / lr.arm_dir(arm)), seed_file or "seed"]

    envs = {}
    real_popen = lr.subprocess.Popen

    def popen(cmd, *a, env=None, **kw):
        if env and "RAY_TMPDIR" in env:
            envs[env["RAY_TMPDIR"]] = env.get("CUDA_VISIBLE_DEVICES")
        return real_popen(cmd, *a, env=env, **kw)

    monkeypatch.setattr(lr, "arm_command", fake_command)
    monkeypatch.setattr(lr.subprocess, "Popen", popen)
    monkeypatch.setattr(lr, "POLL_S", 0.05)
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("")
    root = tmp_path / "learn"
    assert lr.main(["--out", str(root), "--model", "/m", "--seed-file", str(seeds), "--stop-at-step", "4",
                    "--arms", "2t2s@1,2t2s@2,single@1,single@2", "--gpus", "0,1,2,3", "--no-eval",
                    "--arm-override", "2t2s:populora.rollout.proposals_per_type=4",
                    "--arm-override", "single:populora.rollout.proposals_per_type=5",
                    "populora.rollout.student_n=4"]) == 0
    assert seen["2t2s@1"] == seen["2t2s@2"] == ["populora.rollout.student_n=4",
                                                 "populora.rollout.proposals_per_type=4"]
    assert seen["single@2"] == ["populora.rollout.student_n=4", "populora.rollout.proposals_per_type=5"]
    assert envs == {"/tmp/ray_2t2s-seed1": "0", "/tmp/ray_2t2s-seed2": "1", "/tmp/ray_single-seed1": "2",
                    "/tmp/ray_single-seed2": "3"}
    runs = {a: root / a for a in ("2t2s-seed1", "2t2s-seed2", "single-seed1", "single-seed2")}
    assert all(lr.checkpoint_steps(p)[-1] == 4 for p in runs.values())
    cmd = lr.eval_command("/m", runs, 4, root / "eval", None, 768, 0.6, benchmarks="mbpp_plus")
    named = cmd[cmd.index("--adapters") + 1:]
    assert "--baseline" not in cmd and "--run-dir" not in cmd
    # the stand-in trainer writes one member (a0) unless it seeds: every arm's living members, named by arm
    assert sorted(a.split("=")[0] for a in named) == [f"{arm}@4.a0" for arm in sorted(runs)]
    assert all(a.split("=", 1)[1].endswith("step_4/population/adapters/a0") for a in named)
    assert cmd[cmd.index("--benchmarks") + 1] == "mbpp_plus"


def _quick_driver(monkeypatch, tmp_path):
    """No expected-output warm-up, fast polling, an empty given seed set: (seed file, run root)."""
    monkeypatch.setattr(lr, "warm_cache_command", lambda data_dir: [sys.executable, "-c", "pass"])
    monkeypatch.setattr(lr, "POLL_S", 0.05)
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("")
    return seeds, tmp_path / "learn"


FAKE_EVAL = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    out, with_base, names = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
    members = (["base"] if with_base else []) + names
    scores = {m: {"humaneval_plus": {"outcomes": [1, 0, 1, 1]}} for m in members}
    (out / "results.json").write_text(json.dumps({"scores": scores}))
''')


def test_each_arm_is_evaluated_on_its_gpu_as_soon_as_it_reaches_the_stop_step(tmp_path, monkeypatch, capsys):
    """--stop-at-step with one GPU per arm: a fast arm's evaluation starts while slower arms still train; the first
    one also evaluates the base model; every arm is evaluated at the stop step and eval/arms.md compares them."""
    fast, slow = tmp_path / "fast.py", tmp_path / "slow.py"
    fast.write_text(FAKE_TRAINER)
    # The population arms' last step waits until both single agents' evaluations have started: the order under
    # test, whatever a loaded machine does to the processes' start.
    slow.write_text(FAKE_TRAINER.replace("    step += 1\n", (
        "    step += 1\n"
        "    while step == 4 and not all((run.parent / 'eval' / a / 'eval_command.txt').exists()\n"
        "                                for a in ('single-seed1', 'single-seed2')):\n"
        "        time.sleep(0.02)\n")))
    assert slow.read_text() != FAKE_TRAINER
    monkeypatch.setattr(lr, "arm_command", lambda arm, model, root, seed_file, extra: [
        sys.executable, str(slow if arm.startswith("2t2s") else fast), str(root / lr.arm_dir(arm)), seed_file or "seed"])
    evals = tmp_path / "eval.py"
    evals.write_text(FAKE_EVAL)
    calls = []

    def fake_eval(model, run, step, out, data_dir, max_new_tokens, util, with_base):
        real = lr.arm_eval_command.__wrapped__(model, run, step, out, data_dir, max_new_tokens, util, with_base)
        calls.append((run.name, step, with_base, real))
        names = [a.split("=")[0] for a in real[real.index("--adapters") + 1:]]
        return [sys.executable, str(evals), str(out), "1" if with_base else "0", *names]

    fake_eval.__wrapped__ = lr.arm_eval_command
    monkeypatch.setattr(lr, "arm_eval_command", fake_eval)
    seeds, root = _quick_driver(monkeypatch, tmp_path)
    assert lr.main(["--out", str(root), "--model", "/m", "--seed-file", str(seeds), "--stop-at-step", "4",
                    "--arms", "2t2s@1,single@1,2t2s@2,single@2", "--gpus", "0,1,2,3", "--eval-prestart-s", "0"]) == 0
    out = capsys.readouterr().out
    # the single agents (fast) were evaluated before the population arms ended, the first with the base model
    assert out.index("single-seed1: evaluation started") < out.index("arms ended")
    assert [c[2] for c in calls].count(True) == 1 and calls[0][0].startswith("single") and calls[0][2]
    assert {c[0]: c[1] for c in calls} == {"2t2s-seed1": 4, "2t2s-seed2": 4, "single-seed1": 4, "single-seed2": 4}
    real = calls[0][3]
    assert real[real.index("--benchmarks") + 1] == "humaneval_plus,mbpp_plus" and "--no-base" not in real
    assert "--no-base" in calls[-1][3]
    prog = json.loads((root / "progress.json").read_text())
    assert prog["state"] == "finished" and prog["eval_rc"] == 0 and set(prog["eval_steps"].values()) == {4}
    table = (root / "eval" / "arms.md").read_text()
    assert "| single-seed1 - base |" in table and "| 2t2s-seed2 - base |" in table


FAKE_WAITING_EVAL = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    out, with_base, listing = Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])
    (out / "engine_up").write_text(str(listing.exists()))  # the engine is up before the members are known
    while not listing.exists():
        time.sleep(0.02)
    names = [line.split("=")[0] for line in listing.read_text().splitlines() if line.strip()]
    members = (["base"] if with_base else []) + names
    scores = {m: {"humaneval_plus": {"outcomes": [1, 0, 1, 1]}} for m in members}
    (out / "results.json").write_text(json.dumps({"scores": scores}))
''')


def test_the_evaluation_engine_starts_before_the_stop_step_and_gets_the_members_at_it(tmp_path, monkeypatch, capsys):
    """--eval-prestart-s: each arm's evaluation engine starts beside its trainer while the arm still trains (sized
    from the arm's recipe: adapters and LoRA rank), and evaluates the stop step's members once the driver lists
    them; an arm that never checkpoints has its waiting engine stopped."""
    trainer = tmp_path / "trainer.py"
    # The fake steps are logged as 1.5 s each: with 8 of 16 logged, the engine is due (8 x 1.5 s <= 12 s). Step 9
    # waits until that engine is up, so a loaded machine's slow driver or slow engine start cannot let the arm
    # reach its stop step first.
    waits = FAKE_TRAINER.replace("    step += 1\n", (
        "    step += 1\n"
        "    while step == 9 and not (run.parent / 'eval' / run.name / 'engine_up').exists():\n"
        "        time.sleep(0.02)\n"))
    assert waits != FAKE_TRAINER
    trainer.write_text(waits)
    monkeypatch.setattr(lr, "arm_command", lambda arm, model, root, seed_file, extra: [
        sys.executable, str(trainer), str(root / lr.arm_dir(arm)), seed_file or "seed"])
    evals = tmp_path / "eval.py"
    evals.write_text(FAKE_WAITING_EVAL)
    waiting = []

    def fake_waiting(model, listing, wait_s, slots, out, data_dir, max_new_tokens, util, with_base):
        real = lr.waiting_eval_command.__wrapped__(model, listing, wait_s, slots, out, data_dir, max_new_tokens,
                                                   util, with_base)
        waiting.append((out.name, slots, real))
        return [sys.executable, str(evals), str(out), "1" if with_base else "0", str(listing)]

    fake_waiting.__wrapped__ = lr.waiting_eval_command
    monkeypatch.setattr(lr, "waiting_eval_command", fake_waiting)
    monkeypatch.setattr(lr, "arm_eval_command", lambda *a, **k: pytest.fail("an engine started after its arm"))
    seeds, root = _quick_driver(monkeypatch, tmp_path)
    assert lr.main(["--out", str(root), "--model", "/m", "--seed-file", str(seeds), "--stop-at-step", "16",
                    "--arms", "2t2s@1,single@1", "--gpus", "0,1", "--eval-prestart-s", "12",
                    "actor_rollout_ref.model.lora_rank=32"]) == 0
    out = capsys.readouterr().out
    # the recipes' sizes under the run's overrides: 2T2S serves 4 adapters, the single agent 1, both at rank 32
    assert {w[0]: w[1] for w in waiting} == {"2t2s-seed1": (4, 32), "single-seed1": (1, 32)}
    real = waiting[0][2]
    assert real[real.index("--max-loras") + 1] in ("4", "1") and real[real.index("--max-lora-rank") + 1] == "32"
    assert float(real[real.index("--wait") + 1]) >= 60
    assert real[real.index("--kv-cache-gib") + 1] == "8"  # not sized by profiling a card the trainer shares
    for arm in ("2t2s-seed1", "single-seed1"):
        assert out.index(f"{arm}: evaluation engine started ahead") < out.index(f"{arm}: evaluation of step 16 handed")
        assert (root / "eval" / arm / "engine_up").read_text() == "False"
        names = (root / "eval" / arm / "adapters.txt").read_text().split()
        assert all(n.startswith(f"{arm}@16.") for n in names)
    prog = json.loads((root / "progress.json").read_text())
    assert prog["state"] == "finished" and prog["eval_rc"] == 0 and set(prog["eval_steps"].values()) == {16}
    assert "| single-seed1 - base |" in (root / "eval" / "arms.md").read_text()


@pytest.mark.parametrize("flag, value, message", [("--eval-prestart-s", "-1", "--eval-prestart-s must be >= 0"),
                                                  ("--eval-gpu-memory-utilization", "1.5", "must be in (0, 1]")])
def test_evaluation_flags_are_checked_before_anything_starts(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as e:
        lr.main(["--out", str(tmp_path / "learn"), "--model", "/m", flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "learn").exists()


def test_a_hung_arm_is_killed_with_its_stacks_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    """An arm whose steps stop (v2's stuck weight sync) is killed once it is overdue, after its processes' stacks
    are dumped; the run records it and the other arm goes on to its stop step instead of waiting for the deadline."""
    healthy, stuck = tmp_path / "healthy.py", tmp_path / "stuck.py"
    healthy.write_text(FAKE_TRAINER)
    stuck.write_text(FAKE_TRAINER.replace('"timing_s/step": 1.5', '"timing_s/step": 0.05').replace(
        "    step += 1\n", "    step += 1\n    if step == 4:  # steps 1-3 logged, then stuck\n        time.sleep(600)\n"))
    monkeypatch.setattr(lr, "arm_command", lambda arm, model, root, seed_file, extra: [
        sys.executable, str(stuck if arm.startswith("2t2s") else healthy), str(root / lr.arm_dir(arm)),
        seed_file or "seed"])
    spy = tmp_path / "bin" / "py-spy"  # a stand-in py-spy that names the process it was asked about
    spy.parent.mkdir()
    spy.write_text("#!/bin/sh\necho \"Thread 1: waiting in zmq send (pid $3)\"\n")
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", f"{spy.parent}:{os.environ['PATH']}")
    seeds, root = _quick_driver(monkeypatch, tmp_path)
    assert lr.main(["--out", str(root), "--model", "/m", "--seed-file", str(seeds), "--stop-at-step", "30",
                    "--arms", "2t2s@1,single@1", "--no-eval", "--hang-after-s", "1"]) == 0
    out = capsys.readouterr().out
    assert "2t2s-seed1: no step for" in out and "after step 3" in out and "killed" in out
    prog = json.loads((root / "progress.json").read_text())
    assert prog["hung"] == {"2t2s-seed1": 3} and prog["rcs"]["single-seed1"] == 0
    assert prog["rcs"]["2t2s-seed1"] != 0 and lr.checkpoint_steps(root / "single-seed1")[-1] == 30
    stacks = (root / "2t2s-seed1" / "hang_stacks.txt").read_text()
    assert "=== pid" in stacks and "waiting in zmq send" in stacks
    assert "hung: {'2t2s-seed1': 3}" in lr.status(root)


def test_overdue_waits_for_the_first_step_and_scales_with_the_step_time(tmp_path):
    run = tmp_path / "arm"
    run.mkdir()
    assert lr.overdue(run, time.time(), 1) is None  # start-up: no step logged yet
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "populora/validity/mean": 0.1}) + "\n")
    (run / "verl_metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": {"timing_s/step": 20.0}}) + "\n"
                                                    for s in (1, 2, 3)))
    now = (run / "metrics.jsonl").stat().st_mtime
    assert lr.overdue(run, now + 150, 60) is None  # 10 median steps (200 s) is the longer limit here
    assert lr.overdue(run, now + 250, 60) == pytest.approx(250)
    assert lr.overdue(run, now + 250, 0) is None  # 0: never
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert lr.group_pids(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()


V4_BUDGET = ["--arm-override", "2t2s:populora.rollout.proposals_per_type=4",
             "--arm-override", "4t4s:populora.rollout.proposals_per_type=4",
             "--arm-override", "single:populora.rollout.proposals_per_type=5", "populora.rollout.student_n=4"]
RUN_A_SEEDS = lr.RECIPES.parents[1] / "docs" / "results" / "2026-11-26-qwen1.5b" / "run-a-1024" / "seed_tasks.jsonl"


def _model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')  # all the start-up check reads of a model folder
    return model


def test_check_composes_each_arm_runs_its_start_up_checks_and_prints_every_adapter_s_plan(tmp_path, capsys):
    """--check starts nothing: each arm's config as its command composes it passes the trainer's start-up checks
    (no GPU), and every founding member's planned trajectories and tokens per step are printed; at v4's per-adapter
    budget 2T2S, 4T4S and the single agent are compute matched (member mean 30)."""
    pytest.importorskip("hydra")
    pytest.importorskip("verl")
    base = ["--out", str(tmp_path / "learn"), "--model", str(_model_dir(tmp_path)), "--seed-file", str(RUN_A_SEEDS),
            "--check"]
    assert lr.main([*base, "--arms", "single@1,2t2s@1,4t4s@1", *V4_BUDGET]) == 0
    out = capsys.readouterr().out
    assert not list((tmp_path / "learn").glob("*/train.log"))  # nothing was started
    assert "a0   both        30 trained trajectories, at most  30,720 response tokens (15 proposals + 15 solver" in out
    four = out.split("4t4s-seed1 (qwen1.5b_1gpu_4t4s")[1]
    for i in range(4):
        assert f"t{i}   teacher     12 trained trajectories, at most  12,288 response tokens" in four
        assert f"s{i}   student     48 trained trajectories, at most  49,152 response tokens" in four
    assert "s4 " not in four and out.count("mean             30 trained trajectories") == 3
    assert "compute matched: every arm's member mean is 30 trained trajectories (at most 30,720" in out
    assert "max_response_length 1024" in out and "student_n 4" in out

    # the single agent at 4 proposals per type trains 24 a step: not matched, and said so
    assert lr.main([*base, "--arms", "single@1,2t2s@1", *V4_BUDGET[:2], V4_BUDGET[-1],
                    "--arm-override", "single:populora.rollout.proposals_per_type=4"]) == 1
    assert "NOT compute matched: member mean trained trajectories per step single-seed1 24; 2t2s-seed1 30" in (
        capsys.readouterr().out)
    # a config the trainer would refuse at start-up fails here, naming the key, and the others are still checked
    assert lr.main([*base, "--arms", "2t2s@1,single@1", "--arm-override", "2t2s:populora.population.num_students=3",
                    *V4_BUDGET]) == 1
    out = capsys.readouterr().out
    assert "2t2s-seed1: FAILED: populora.population.num_students: 2 teacher(s) x 1 student(s)" in out
    assert "single-seed1 (qwen1.5b_1gpu_single" in out and "start-up checks failed: 2t2s-seed1" in out


def test_v5_launcher_runs_two_seeds_of_each_arm_per_node_at_the_v4_budget(tmp_path):
    """scripts/gpu/learning_run_v5.sh: 1 -> seeds 1 and 2, 2 -> seeds 3 and 4, the single agents on GPUs 0-1 and
    the population on 2-3, stopping at step 40; its check mode composes and checks all four arms on a CPU."""
    pytest.importorskip("hydra")
    pytest.importorskip("verl")
    repo = lr.RECIPES.parents[1]
    env = dict(os.environ, PYTHON=sys.executable, MODEL=str(_model_dir(tmp_path)), LEARN_OUT=str(tmp_path / "learn"),
               PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    script = repo / "scripts" / "gpu" / "learning_run_v5.sh"
    done = subprocess.run(["bash", str(script), "2", "check"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    heads = re.findall(r"^(\S+) \(qwen1\.5b_1gpu_\w+, resident adapters\): start-up checks passed", done.stdout, re.M)
    assert heads == ["single-seed3", "single-seed4", "2t2s-seed3", "2t2s-seed4"]
    assert "compute matched: every arm's member mean is 30 trained trajectories" in done.stdout
    assert (tmp_path / "learn" / "seed_tasks.jsonl").read_bytes() == RUN_A_SEEDS.read_bytes()  # v3's and v4's seeds
    for bad in (["3"], ["1", "go"]):
        assert subprocess.run(["bash", str(script), *bad], cwd=repo, env=env, capture_output=True).returncode == 2
    bad_pop = subprocess.run(["bash", str(script), "1", "check"], cwd=repo, env={**env, "POP": "8t8s"},
                             capture_output=True, text=True)
    assert bad_pop.returncode == 2 and "POP must be 2t2s or 4t4s" in bad_pop.stderr
    # start mode: what learning_run.sh start is handed (a stand-in that prints its arguments, in a copy of the tree)
    tree = tmp_path / "tree"
    (tree / "scripts" / "gpu").mkdir(parents=True)
    for name in ("learning_run_v5.sh", "learning_run_4gpu.sh"):
        (tree / "scripts" / "gpu" / name).write_text((repo / "scripts" / "gpu" / name).read_text())
    (tree / "scripts" / "gpu" / "learning_run.sh").write_text('echo "$@"\n')
    started = subprocess.run(["bash", "scripts/gpu/learning_run_v5.sh", "1"], cwd=tree, capture_output=True,
                             text=True, env={**env, "SEEDS": str(RUN_A_SEEDS)})
    assert started.returncode == 0, started.stderr
    args = started.stdout.split()
    assert args[0] == "start" and args[args.index("--arms") + 1] == "single@1,single@2,2t2s@1,2t2s@2"
    assert args[args.index("--gpus") + 1] == "0,1,2,3" and args[args.index("--stop-at-step") + 1] == "40"
    assert args[args.index("--stop-after-min") + 1] == "23" and args[args.index("--seed-file") + 1].endswith(
        "learn/seed_tasks.jsonl")
    assert {"2t2s:populora.rollout.proposals_per_type=4", "single:populora.rollout.proposals_per_type=5",
            "populora.rollout.student_n=4", "trainer.save_freq=20"} <= set(args)
    four = subprocess.run(["bash", "scripts/gpu/learning_run_v5.sh", "2"], cwd=tree, capture_output=True, text=True,
                          env={**env, "SEEDS": str(RUN_A_SEEDS), "POP": "4t4s", "MINUTES": "33"}).stdout.split()
    assert four[four.index("--arms") + 1] == "single@3,single@4,4t4s@3,4t4s@4"
    assert four[four.index("--stop-after-min") + 1] == "33" and "4t4s:populora.rollout.proposals_per_type=4" in four
