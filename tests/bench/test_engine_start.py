"""The compile-cache start-up benchmark: arms alternate, each start gets its own cache switch and folder, and the
cold start of the cached arm is reported apart from its warm starts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from populora_verl.bench import child
from populora_verl.bench import engine_start as es


@pytest.fixture
def model(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return tmp_path / "m"


def test_arms_alternate_and_cold_is_reported_apart_from_warm(model, tmp_path, capsys):
    calls = []

    def fake_start(arm: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
        env = es.child_env(arm, root, base={})
        calls.append((arm, env["VLLM_DISABLE_COMPILE_CACHE"], env["VLLM_CACHE_ROOT"]))
        # 'on' compiles the first time only; 'off' always compiles
        cold = arm == "off" or sum(c[0] == "on" for c in calls) == 1
        return {"total_s": 100.0 if cold else 60.0, "import_s": 20.0, "engine_s": 80.0 if cold else 40.0}

    rc = es.main(["--model", str(model), "--rounds", "3", "--cache-root", str(tmp_path / "c")], start=fake_start)
    assert rc == 0
    assert [c[0] for c in calls] == ["off", "on", "on", "off", "off", "on"]
    assert {c[0]: c[1] for c in calls} == {"off": "1", "on": "0"}
    assert {c[0]: c[2] for c in calls} == {"off": str(tmp_path / "c" / "off"), "on": str(tmp_path / "c" / "on")}
    out = capsys.readouterr().out
    assert "| off | 3 | 100.0 | 100.0-100.0 | 20.0 | 80.0 | 1.00 |" in out
    assert "| on, cold | 1 | 100.0 |" in out
    assert "| on, warm | 2 | 60.0 | 60.0-60.0 | 20.0 | 40.0 | 0.60 |" in out


def test_the_cached_arm_starts_from_an_empty_cache(model, tmp_path):
    stale = tmp_path / "c" / "on" / "torch_compile_cache"
    stale.mkdir(parents=True)
    seen = []
    es.main(["--model", str(model), "--rounds", "2", "--cache-root", str(tmp_path / "c")],
            start=lambda arm, args, root: seen.append((arm, (root / arm).exists())) or
            {"total_s": 1.0, "import_s": 0.5, "engine_s": 0.5})
    assert seen[:2] == [("off", False), ("on", False)]


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "1"], "--rounds must be at least 2"),
    (["--model", "/nonexistent"], "not a HF model folder"),
])
def test_bad_arguments_stop_in_one_line(model, argv, message, capsys):
    args = ["--model", str(model), *argv] if argv[0] != "--model" else argv
    with pytest.raises(SystemExit) as e:
        es.main(args, start=lambda *a: pytest.fail("no start may run"))
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_failed_start_says_why(model, tmp_path, monkeypatch):
    """run_child on a child that cannot start (no vLLM on this machine): the error carries the child's output."""
    class Done:
        returncode, stdout, stderr = 1, "", "ModuleNotFoundError: No module named 'vllm'"

    monkeypatch.setattr(child.subprocess, "run", lambda cmd, **kw: Done())
    args = es._parser().parse_args(["--model", str(model)])
    with pytest.raises(RuntimeError, match=r"engine start \(on\) failed with exit status 1:\n.*No module named"):
        es.run_child("on", args, tmp_path)


def test_run_child_reads_the_childs_timings(model, tmp_path, monkeypatch):
    seen = {}

    class Done:
        returncode, stderr = 0, ""
        stdout = "INFO noise\nENGINE_START " + json.dumps({"import_s": 12.5, "engine_s": 40.0}) + "\n"

    def fake_run(cmd, **kw):
        seen.update(cmd=cmd, env=kw["env"])
        return Done()

    monkeypatch.setattr(child.subprocess, "run", fake_run)
    args = es._parser().parse_args(["--model", str(model), "--max-loras", "16"])
    t = es.run_child("off", args, tmp_path)
    assert t["import_s"] == 12.5 and t["engine_s"] == 40.0 and t["total_s"] >= 0
    assert seen["cmd"][:4] == [sys.executable, "-m", "populora_verl.bench.engine_start", "--child"]
    assert "--max-loras" in seen["cmd"] and seen["cmd"][seen["cmd"].index("--max-loras") + 1] == "16"
    assert seen["env"]["VLLM_DISABLE_COMPILE_CACHE"] == "1"
