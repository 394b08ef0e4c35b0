"""Multi-GPU start-up checks: the GPU layout keys against each other, and resuming a bank at another world size."""

from __future__ import annotations

import pytest

from populora_verl.config import ConfigError, load_config
from populora_verl.trainer import verl_config
from populora_verl.workers.adapter_bank import AdapterBankError, bank_file_for, bank_filename

from _shared import REPO, compose_recipe


def _layout(name: str, *overrides: str) -> verl_config.ParallelLayout:
    cfg = compose_recipe(name, ["actor_rollout_ref.model.path=/m", *overrides] if name == "smoke_0.5b"
                         else list(overrides))
    pcfg = load_config(cfg.populora)
    verl_config.validate_verl_config(cfg, pcfg)
    return verl_config.parallel_layout(cfg, pcfg)


@pytest.mark.parametrize("overrides,expected", [
    ((), dict(n_gpus=1, replicas=1, rollout_tp=1, actor_dp=1, fsdp_size=1)),
    (("trainer.n_gpus_per_node=2",), dict(n_gpus=2, replicas=2, rollout_tp=1, actor_dp=2, fsdp_size=2)),
    (("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
     dict(n_gpus=2, replicas=1, rollout_tp=2, actor_dp=2, fsdp_size=2)),
    (("trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
     dict(n_gpus=4, replicas=2, rollout_tp=2, actor_dp=4, fsdp_size=4)),
    (("trainer.n_gpus_per_node=8", "trainer.nnodes=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=8"),
     dict(n_gpus=16, nnodes=2, replicas=16, actor_dp=16, fsdp_size=8)),
    (("trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"),
     dict(n_gpus=4, actor_dp=2)),
])
def test_layout_of_one_to_many_gpus(overrides, expected):
    layout = _layout("smoke_0.5b", *overrides)
    assert {k: getattr(layout, k) for k in expected} == expected
    assert layout.adapters == 4 and layout.max_loras == 8
    assert f"{layout.replicas} vLLM replica(s)" in layout.describe()


def test_paper_recipe_layout():
    layout = _layout("4t4s")
    assert (layout.n_gpus, layout.replicas, layout.adapters, layout.max_loras) == (8, 8, 8, 8)


BAD = [
    (("trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
     "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    (("trainer.n_gpus_per_node=4", "trainer.nnodes=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
      "actor_rollout_ref.rollout.data_parallel_size=1"), None),  # 8 GPUs = two whole nodes: allowed
    (("trainer.n_gpus_per_node=4", "trainer.nnodes=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=6"),
     "actor_rollout_ref.rollout.tensor_model_parallel_size"),  # divides 12 but spans 1.5 nodes
    (("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.data_parallel_size=4"),
     "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    (("trainer.n_gpus_per_node=0",), "trainer.n_gpus_per_node"),
    (("trainer.nnodes=null",), "trainer.nnodes"),
    (("trainer.n_gpus_per_node=6", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"),
     "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    (("trainer.n_gpus_per_node=6", "actor_rollout_ref.actor.fsdp_config.fsdp_size=4"),
     "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
    (("actor_rollout_ref.actor.fsdp_config.fsdp_size=0",), "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
    (("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras=2"),
     "actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras"),  # per replica: every replica serves all 4
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[str(k) + "-" + "-".join(o) for o, k in BAD])
def test_bad_layout_fails_at_start_up_naming_the_key(overrides, key):
    cfg = compose_recipe("smoke_0.5b", ["actor_rollout_ref.model.path=/m", *overrides])
    if key is None:
        verl_config.validate_verl_config(cfg, load_config(cfg.populora))
        return
    with pytest.raises(ConfigError) as e:
        verl_config.validate_verl_config(cfg, load_config(cfg.populora))
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg, msg


def test_bank_file_for_refuses_another_world_size(tmp_path):
    for r in range(2):
        (tmp_path / bank_filename(2, r)).write_bytes(b"x")
    assert bank_file_for(str(tmp_path), 2, 1) == str(tmp_path / bank_filename(2, 1))
    with pytest.raises(AdapterBankError) as e:
        bank_file_for(str(tmp_path), 4, 3)
    msg = str(e.value)
    assert "saved by 2 rank(s) but this run has 4" in msg and "trainer.n_gpus_per_node" in msg and "\n" not in msg
    with pytest.raises(AdapterBankError, match="no adapter bank for world size 2, rank 0"):
        bank_file_for(str(tmp_path / "missing"), 2, 0)


def test_bank_files_the_driver_cannot_see_are_reported(tmp_path, caplog):
    seen = tmp_path / bank_filename(2, 0)
    seen.write_bytes(b"x")
    other_node = str(tmp_path / "elsewhere" / bank_filename(2, 1))
    assert verl_config.warn_if_bank_not_shared([str(seen), None]) == []
    with caplog.at_level("WARNING"):
        assert verl_config.warn_if_bank_not_shared([str(seen), other_node]) == [other_node]
    assert "1 of 2 adapter bank file(s)" in caplog.text and "trainer.default_local_dir" in caplog.text


# --- multi-GPU debug probes (what scripts/gpu/multi_gpu_proof.sh greps) ------------------------------------------

from populora_verl.trainer import probes  # noqa: E402


def _sums(rank, **slots):
    return {"rank": rank, "slots": {int(k[1:]): v for k, v in slots.items()}}


def test_rank_report_flags_a_rank_that_changed_other_slots():
    before = [_sums(0, s0="a", s1="b", s2="c"), _sums(1, s0="d", s1="e", s2="f")]
    good = [_sums(0, s0="a", s1="B", s2="c"), _sums(1, s0="d", s1="E", s2="f")]
    line, ok = probes.rank_report(3, before, good, [1])
    assert ok and line == "[populora] step 3 rank checksums: rank0:[1] rank1:[1] | trained=[1] OK"
    stale = [_sums(0, s0="a", s1="B", s2="c"), _sums(1, s0="d", s1="e", s2="f")]  # rank 1 kept its old shard
    line, ok = probes.rank_report(3, before, stale, [1])
    assert not ok and "rank1:[]" in line and line.endswith("MISMATCH")
    assert not probes.rank_report(3, [], [], [1])[1]  # no ranks answered: not a pass


TABLE = {"t0": {"lora_int_id": 1000, "lora_name": "0@v0"}, "s0": {"lora_int_id": 1003, "lora_name": "1@v1"}}


def test_replica_report_needs_every_id_on_every_replica():
    out = {"t0": {"token_ids": [1, 2], "sum_logp": -1.0}, "s0": {"token_ids": [1, 3], "sum_logp": -2.0}}
    lines, ok = probes.replica_report(4, [{"loaded": [1000, 1003], "outputs": out},
                                          {"loaded": [1000, 1003, 1001], "outputs": out}], TABLE)
    assert ok and lines[0].startswith("[populora] step 4 replica probe: 2 replica(s), every LoRA id on every replica OK")
    assert "2/2 adapters" in lines[0] and "replica 1: 2/2 LoRA ids loaded, 2/2 distinct" in lines[2]
    # Replica 1 never got the evolved id 1003 (a weight sync that reached one replica only).
    lines, ok = probes.replica_report(4, [{"loaded": [1000, 1003], "outputs": out},
                                          {"loaded": [1000, 1001], "outputs": out}], TABLE)
    assert not ok and "missing [1003]" in lines[2] and "MISMATCH" in lines[0]
    lines, ok = probes.replica_report(4, [{"error": "RayActorError: dead"}], TABLE)
    assert not ok and "probe failed" in lines[1]


def test_probe_replicas_sends_each_member_to_each_replica(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda x: x)
    sent = []

    class _Out:
        def __init__(self, lid):
            self.token_ids, self.log_probs = [lid % 7], [-0.5, -lid / 1000]

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    class _Server:
        def __init__(self, i):
            self.populora_live_loras = _Method(lambda: {"loaded": [1000, 1003]})
            self.generate = _Method(lambda ids, sp, rid, populora_lora: sent.append((i, populora_lora["lora_int_id"],
                                                                                     sp["temperature"]))
                                    or _Out(populora_lora["lora_int_id"]))

    class _Replica:
        def __init__(self, i):
            self.server_handle = _Server(i)

    res = probes.probe_replicas([_Replica(0), _Replica(1)], [1, 2, 3], TABLE)
    assert sorted(sent) == [(0, 1000, 0.0), (0, 1003, 0.0), (1, 1000, 0.0), (1, 1003, 0.0)]
    assert res[1]["outputs"]["s0"] == {"token_ids": [1003 % 7], "sum_logp": -0.5 - 1.003}
    assert probes.replica_report(2, res, TABLE)[1]


def test_prompt_ids_with_and_without_chat_template():
    class _Tok:
        def __init__(self, template):
            self.template = template

        def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
            if not self.template:
                raise ValueError("no chat template")
            return f"<u>{msgs[0]['content']}</u><a>"

        def encode(self, text, add_special_tokens):
            return [len(text), ord(text[0])]

    assert probes.prompt_ids(_Tok(True), "hi") == [len("<u>hi</u><a>"), ord("<")]
    assert probes.prompt_ids(_Tok(False), "hi") == [2, ord("h")]


# --- the GPU-count scaling benchmark (logic only: the runs need GPUs) -------------------------------------------

from populora_verl.bench import gpu_scaling  # noqa: E402

H100_RUN = REPO / "docs" / "gpu" / "step_scaling_h100_bypass" / "4t4s.metrics.jsonl"


def test_gpu_scaling_reads_tokens_and_step_time_of_a_real_run():
    from populora_verl.bench import step_scaling as ss

    step_s, tokens, phases = gpu_scaling.figures(ss.file_log_rows(H100_RUN.read_text()))
    assert tokens[2] == 29678 and abs(step_s[2] - 34.64084849699998) < 1e-9  # the H100 4T4S run's step 2
    row = gpu_scaling.ScalingRow(1, 1, "4t4s", "NVIDIA H100 80GB HBM3", 0, 1.0, step_s, tokens, phases)
    steady = [k for k in step_s if k >= 2]
    assert row.tokens_per_s == pytest.approx(sum(tokens[k] for k in steady) / sum(step_s[k] for k in steady))
    assert set(phases) == set(gpu_scaling.PHASES)


def test_gpu_scaling_speedup_only_against_one_gpu_of_the_same_kind():
    def row(g, name, s):
        return gpu_scaling.ScalingRow(g, 1, "4t4s", name, 0, 1.0, {1: 99.0, 2: s, 3: s}, {1: 1.0, 2: 3000.0, 3: 3000.0})

    rows = [row(1, "H100", 30.0), row(2, "H100", 16.0), row(4, "H200", 8.0)]
    table = gpu_scaling.report(rows)
    assert "| smoke_0.5b | 4t4s | - | fixed | 2 | 2 x TP1 | H100 | 16.0 | 188 | 1.88x | >= 1.7x |" in table
    assert "| smoke_0.5b | 4t4s | - | fixed | 4 | 4 x TP1 | H200 | 8.0 | 375 | - | >= 3.2x |" in table  # no H200 1-GPU row: no ratio
    # nor against a 1-GPU row of another speed profile
    other = gpu_scaling.ScalingRow(2, 1, "4t4s", "H100", 0, 1.0, {2: 16.0}, {2: 3000.0}, profile="varlen")
    assert "| smoke_0.5b | 4t4s | varlen | fixed | 2 | 2 x TP1 | H100 | 16.0 | 188 | - |" in gpu_scaling.report([*rows, other])
    uneven = gpu_scaling.ScalingRow(2, 1, "4t4s", "H100", 0, 1.0, {2: 10.0, 3: 20.0, 4: 40.0},
                                    {2: 3000.0, 3: 3000.0, 4: 3000.0})
    assert uneven.tokens_per_s_range() == (75.0, 150.0, 300.0)  # per-step spread: min, median, max
    assert "| 75 / 150 / 300 | 3 |" in gpu_scaling.report([uneven])
    assert gpu_scaling.overrides_for(4, 2) == ["trainer.n_gpus_per_node=4", "trainer.nnodes=1",
                                                "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]


def test_gpu_scaling_reads_the_start_up_the_trainer_printed(tmp_path, monkeypatch):
    line = ("(TaskRunnerV1 pid=8924) [populora] start-up: ray + task runner 47 s | task runner setup 43 s | workers + "
            "vLLM 288 s | checkpoint + weight sync 14 s | agent loop 0 s | step 1 130 s | total 521 s")
    from populora_verl.trainer.timeline import Timeline, total_seconds

    assert total_seconds(f"noise\n{line}\nstep:1 - x:1\n") == 521.0
    assert total_seconds("no timeline here") is None
    written = Timeline(start=100.0)  # the parser reads what the trainer's own timeline prints
    written.mark("workers + vLLM", at=290.0)
    written.mark("step 1", at=412.0)
    assert total_seconds(written.line()) == 312.0

    from pathlib import Path

    def fake_run(cmd, **kw):  # the trainer: its log and its metrics file
        kw["stdout"].write(f"{line}\n")
        Path(kw["env"]["VERL_FILE_LOGGER_PATH"]).write_text(H100_RUN.read_text())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_scaling.subprocess, "run", fake_run)
    monkeypatch.setattr(gpu_scaling, "_gpu_name", lambda: "H200")
    row = gpu_scaling.run_one("/m", "4t4s", 1, 1, 5, tmp_path, [], 60, "varlen")
    assert row.rc == 0 and row.startup_s == 521.0 and row.tokens_per_s
    assert "| 521 |" in gpu_scaling.report([row])


def test_gpu_scaling_rows_round_trip_and_refuse_without_gpus(tmp_path, capsys):
    r = gpu_scaling.ScalingRow(2, 2, "4t4s", "H100", 0, 5.0, {2: 10.0}, {2: 100.0}, {"gen": 5.0}, 1234.0)
    gpu_scaling.save_rows(tmp_path / "results.json", [r])
    (back,) = gpu_scaling.load_rows(tmp_path / "results.json")
    assert back == r and back.tokens_per_s == 10.0
    assert gpu_scaling.main(["--model", "/m", "--gpus", "1,2", "--out", str(tmp_path)]) == 2
    assert "needs 2 CUDA GPU(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_scaling.main(["--model", "/m", "--gpus", "2,3", "--tp", "2"])


def test_gpu_scaling_runs_every_row_with_the_profile_and_forced_answers(tmp_path, monkeypatch):
    import torch

    calls = []

    def fake_run_one(model, config, gpus, tp, steps, out, extra, timeout_s, profile, per_gpu_proposals, recipe):
        calls.append((gpus, tp, extra, profile, recipe))
        return gpu_scaling.ScalingRow(gpus, tp, config, "H100", 0, 1.0, {2: 10.0 / gpus}, {2: 1000.0}, profile=profile,
                                      per_gpu_proposals=per_gpu_proposals)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gpu_scaling, "run_one", fake_run_one)
    assert gpu_scaling.main(["--model", "/m", "--gpus", "1,2", "--out", str(tmp_path), "trainer.x=1"]) == 0
    assert [(g, tp, p, r) for g, tp, _, p, r in calls] == [(1, 1, "varlen", "smoke_0.5b"), (2, 1, "varlen", "smoke_0.5b")]
    extra = calls[0][2]
    assert "data.max_response_length=1024" in extra and "actor_rollout_ref.rollout.ignore_eos=true" in extra
    assert "actor_rollout_ref.model.use_remove_padding=true" in extra and extra[-1] == "trainer.x=1"
    table = (tmp_path / "results.md").read_text()
    assert "| smoke_0.5b | 4t4s | varlen | fixed | 2 | 2 x TP1 | H100 | 5.0 | 200 | 2.00x | >= 1.7x |" in table
    assert not any("proposals_per_type" in x for x in extra)  # the recipe's work on every GPU count
    # weak scaling: the step's work grows with the GPUs, and its rows are compared only with each other
    calls.clear()
    assert gpu_scaling.main(["--model", "/m", "--gpus", "1,2", "--out", str(tmp_path), "--per-gpu-proposals", "3"]) == 0
    assert [c[2][-1] for c in calls] == [f"populora.rollout.proposals_per_type={n}" for n in (3, 6)]
    table = (tmp_path / "results.md").read_text()
    assert ("| smoke_0.5b | 4t4s | varlen | 6 proposals/type | 2 | 2 x TP1 | H100 | 5.0 | 200 | 2.00x (1.00 per GPU) "
            "| >= 0.85 per GPU |") in table
    assert "| smoke_0.5b | 4t4s | varlen | fixed | 2 | 2 x TP1 | H100 | 5.0 | 200 | 2.00x |" in table  # the fixed rows are kept
    with pytest.raises(SystemExit):
        gpu_scaling.main(["--model", "/m", "--gpus", "1", "--per-gpu-proposals", "0"])
    # another recipe: its rows are compared only with its own 1-GPU row, and a misspelt one stops at once
    calls.clear()
    assert gpu_scaling.main(["--model", "/m", "--gpus", "1,2", "--out", str(tmp_path), "--per-gpu-proposals", "5",
                             "--recipe", "qwen1.5b_4gpu_4t4s"]) == 0
    assert {c[4] for c in calls} == {"qwen1.5b_4gpu_4t4s"}
    rows = gpu_scaling.load_rows(tmp_path / "results.json")
    assert len({r.key for r in rows}) == len(rows) == 6
    with pytest.raises(SystemExit):
        gpu_scaling.main(["--model", "/m", "--gpus", "1", "--recipe", "qwen_4gpu"])


# --- scripts/gpu/multi_gpu_checks.sh against lines printed by the Python code above ------------------------------

import subprocess  # noqa: E402

SCRIPT = REPO / "scripts" / "gpu" / "multi_gpu_checks.sh"


def _run_checks(folder, n: int, tp: int) -> subprocess.CompletedProcess:
    """scripts/gpu/multi_gpu_checks.sh over the proof logs in ``folder``, for N GPUs and rollout TP ``tp``."""
    return subprocess.run(["bash", str(SCRIPT), str(folder), str(n), str(tp)], capture_output=True, text=True)


def _fake_proof_logs(tmp_path, n: int, tp: int, *, stale_rank: bool = False, evolved: bool = True,
                     one_run: bool = False) -> None:
    layout = _layout("smoke_0.5b", f"trainer.n_gpus_per_node={n}",
                     f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                     "populora.population.num_teachers=4", "populora.population.num_students=4")
    table = {f"m{i}": {"lora_int_id": 1000 + i, "lora_name": f"{i}@v0"} for i in range(8)}
    ids = sorted(t["lora_int_id"] for t in table.values())

    def replicas(step, distinct):
        res = [{"loaded": ids, "outputs": {m: {"token_ids": [1], "sum_logp": -float(i if distinct else 0)}
                                           for i, m in enumerate(table)}} for _ in range(n // tp)]
        return probes.replica_report(step, res, table)[0]

    def ranks(step):
        before = [{"rank": r, "slots": {k: "a" for k in range(8)}} for r in range(n)]
        after = [{"rank": r, "slots": {k: ("b" if not (stale_rank and r == n - 1) else "a") for k in range(8)}}
                 for r in range(n)]
        return probes.rank_report(step, before, after, list(range(8)))[0]

    run1 = [f"[populora] layout: {layout.describe()}", *replicas(1, False), ranks(1), *replicas(2, True), ranks(2)]
    if evolved:  # the trainer's line (trainer.py, PBT event)
        run1.append("[populora] step 2 evolution: t1 (slot 1) <- t4 = neftune(t0)")
    if one_run:  # MGPU_PHASE=one: the same run goes on to step 3
        run1 += [*replicas(3, True), ranks(3)]
        (tmp_path / "run1_steps1-3.log").write_text("\n".join(run1) + "\n")
        return
    run2 = [*replicas(3, True), ranks(3), *replicas(4, True), ranks(4)]
    (tmp_path / "run1_steps1-2.log").write_text("(TaskRunner pid=1) " + "\n(TaskRunner pid=1) ".join(run1) + "\n")
    (tmp_path / "run2_resume_to4.log").write_text("\n".join(run2) + "\n")


@pytest.mark.parametrize("n,tp", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_multi_gpu_checks_pass_on_the_lines_the_trainer_prints(tmp_path, n, tp):
    _fake_proof_logs(tmp_path, n, tp)
    res = _run_checks(tmp_path, n, tp)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MISS" not in res.stdout and res.stdout.count("OK   ") == 5 + n // tp


@pytest.mark.parametrize("evolved", [True, False])
def test_multi_gpu_checks_of_one_run_to_step_3(tmp_path, evolved):
    _fake_proof_logs(tmp_path, 2, 1, evolved=evolved, one_run=True)
    res = _run_checks(tmp_path, 2, 1)
    assert "OK   every rank changed exactly the trained slots at step 3" in res.stdout
    if evolved:
        assert res.returncode == 0 and res.stdout.count("OK   ") == 5 + 2, res.stdout
        assert "OK   evolved adapters (step 2) served by every replica at step 3" in res.stdout
    else:
        assert res.returncode == 1
        assert "MISS evolved adapters (step 2) served by every replica at step 3: step 2 did not evolve" in res.stdout


def test_multi_gpu_checks_catch_a_rank_with_a_stale_shard(tmp_path):
    _fake_proof_logs(tmp_path, 2, 1, stale_rank=True)
    res = _run_checks(tmp_path, 2, 1)
    assert res.returncode == 1
    assert "MISS every rank changed exactly the trained slots (step 1)" in res.stdout
    assert "MISS a per-rank or per-replica MISMATCH was logged" in res.stdout


def test_multi_gpu_checks_refuse_the_after_evolution_check_when_nothing_evolved(tmp_path):
    # The x4 run of 2026-11-26 passed this check although pbt.min_age kept step 2 from evolving.
    _fake_proof_logs(tmp_path, 2, 1, evolved=False)
    res = _run_checks(tmp_path, 2, 1)
    assert res.returncode == 1
    assert "MISS evolved adapters (step 2) served by every replica after resume: step 2 did not evolve" in res.stdout


def test_gpu_proof_makes_step_2_evolve():
    text = (REPO / "scripts" / "gpu_proof.sh").read_text()
    assert "populora.pbt.min_age=0" in text and "populora.pbt.final_quiet_steps=0" in text


def _stand_in_verl(tmp_path, lines_of_step) -> dict:
    """PATH with a ``python`` that answers gpu_proof.sh's start-up checks and prints a run's lines per step."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    steps = "\n".join(f'[ $s -ge {k} ] && printf "%s\\n" {" ".join(repr(x) for x in v)}' for k, v in lines_of_step.items())
    (bin_dir / "python").write_text(
        '#!/bin/bash\n[ "$1" = -c ] && exit 0\n'
        's=$(printf "%s\\n" "$@" | sed -n "s/^trainer.total_training_steps=//p")\n'
        f'{steps}\nfor i in $(seq 1 $s); do echo "step:$i - timing_s/step:1.0"; done\n')
    (bin_dir / "python").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


@pytest.mark.parametrize("evolves", [True, False])
def test_gpu_proof_one_run_checks_evolution_without_a_resume(tmp_path, evolves):
    step2 = ["[populora] step 2 greedy probe: 3/4 distinct outputs, 3/4 distinct greedy log-probs",
             "[populora] step 2: checkpoint /x/global_step_2"]
    if evolves:
        step2.append("[populora] step 2 evolution: t1 (slot 1) <- t2 = neftune(t0)")
    env = _stand_in_verl(tmp_path, {
        1: ["[populora] seeding: 2 rounds, 3 seed tasks -> /x", "[populora] step 1 greedy probe: 1/4 distinct outputs",
            '[populora] step 1 t0: rollout_vs_trainer={"rollout_probs_diff_max": 0.1}',
            "[populora] step 1 bank checksums: t0@0:a->b OK"],
        2: step2,
        3: ["[populora] step 3 greedy probe: 4/4 distinct outputs, 4/4 distinct greedy log-probs"]})
    script = REPO / "scripts" / "gpu_proof.sh"
    res = subprocess.run(["bash", str(script), "/model", str(tmp_path / "proof")], capture_output=True, text=True,
                         env=dict(env, GPU_PROOF_PHASE="one"), timeout=60)
    out = res.stdout
    assert "=== gpu_proof: run1_steps1-3 (total_training_steps=3) ===" in out
    assert "SKIP resume from step 2" in out and "OK   reached step 3" in out
    assert "run2" not in out  # no second run
    if evolves:
        assert res.returncode == 0 and "MISS" not in out, out + res.stderr
        assert "OK   greedy outputs differ by LoRA id after evolution" in out
    else:
        assert res.returncode == 1
        assert "MISS greedy outputs differ by LoRA id after evolution: step 2 did not evolve" in out
        assert "MISS evolution at step 2" in out
    res = subprocess.run(["bash", str(script), "/model", str(tmp_path / "proof")], capture_output=True, text=True,
                         env=dict(env, GPU_PROOF_PHASE="both"), timeout=60)
    assert res.returncode == 2 and "GPU_PROOF_PHASE must be all, run1, run2 or one, got 'both'" in res.stderr


def test_multi_gpu_proof_script_streams_step_lines_keeps_the_exit_code_and_checks_gpu_choice(tmp_path):
    """scripts/gpu/multi_gpu_proof.sh's plumbing with a stand-in gpu_proof.sh, env.sh and nvidia-smi."""
    import os
    import shutil

    repo = REPO
    (tmp_path / "scripts" / "gpu").mkdir(parents=True)
    for f in ("multi_gpu_proof.sh", "multi_gpu_checks.sh"):
        shutil.copy(repo / "scripts" / "gpu" / f, tmp_path / "scripts" / "gpu" / f)
    (tmp_path / "scripts" / "gpu" / "env.sh").write_text("export MODEL_DIR=/m\n")
    (tmp_path / "scripts" / "gpu_proof.sh").write_text(
        'echo "=== gpu_proof: run1_steps1-2 (total_training_steps=2) ==="; mkdir -p "$2"\n'
        'for i in 1 2; do echo "(TaskRunnerV1 pid=1) [populora] step $i rank checksums: rank0:[0] | trained=[0] OK"; '
        'echo "vllm noise $i"; done | tee "$2/run1_steps1-2.log"\n'
        'echo "CUDA=$CUDA_VISIBLE_DEVICES" > "$2/cuda.txt"; echo "run1_steps1-2 exit=0"; exit 3\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/bash\n[ "$1" = --list-gpus ] && { for i in 0 1 2 3; do echo GPU$i; done; '
                                        'exit 0; }\necho H100\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), MGPU_PHASE="run1",
               MGPU_DIR=str(tmp_path / "proof"), CUDA_VISIBLE_DEVICES="2,3")
    res = subprocess.run(["bash", "scripts/gpu/multi_gpu_proof.sh", "proof", "2", "replicas"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stdout + res.stderr  # the proof's own exit code, not the pipeline's
    live = res.stdout.split("--- summary of")[0]
    assert "[populora] step 2 rank checksums" in live and "vllm noise" not in live
    assert (tmp_path / "proof" / "cuda.txt").read_text().strip() == "CUDA=2,3"  # the caller's GPUs kept
    assert (tmp_path / "out" / "2gpu_replicas_run1_steps1-2.log").exists()
    env["CUDA_VISIBLE_DEVICES"] = "3"
    res = subprocess.run(["bash", "scripts/gpu/multi_gpu_proof.sh", "proof", "2", "replicas"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "has fewer than 2 GPUs" in res.stdout
