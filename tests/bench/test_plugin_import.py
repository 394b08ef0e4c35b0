"""The plugin-import benchmark's arms, table and command line, with a stand-in measurement (a real round starts three
fresh interpreters that import verl: tens of seconds)."""

from __future__ import annotations

import pytest

from populora_verl.bench import plugin_import as bench


def test_the_arms_load_the_plugin_by_module_and_no_entry_point():
    base = {"VERL_USE_EXTERNAL_PLUGINS": "auto", "VERL_USE_EXTERNAL_MODULES": "other.plugin", "PATH": "/bin"}
    alone = bench.child_env("verl", base)
    assert alone["VERL_USE_EXTERNAL_PLUGINS"] == "none" and "VERL_USE_EXTERNAL_MODULES" not in alone
    for arm in ("plugin", "task_runner"):
        env = bench.child_env(arm, base)
        assert env["VERL_USE_EXTERNAL_PLUGINS"] == "none" and env["VERL_USE_EXTERNAL_MODULES"] == bench.PLUGIN
        assert env["PATH"] == "/bin"


def test_the_child_programs_compile_and_time_the_task_runners_lookup():
    for arm in bench.ARMS:
        compile(bench.child_code(arm), f"<{arm}>", "exec")
    assert 'get_trainer_cls("populora")' in bench.child_code("task_runner")
    assert "get_trainer_cls" not in bench.child_code("plugin")


class _Fake:
    """Seconds per arm, 0.5 s more on its second run; the arms in the order they ran."""

    SECONDS = {"verl": 4.0, "plugin": 4.25, "task_runner": 7.0}
    MODULES = {"verl": 3119, "plugin": 3124, "task_runner": 5426}

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, arm: str, timeout_s: float) -> dict[str, float]:
        extra = 0.5 * self.calls.count(arm)
        self.calls.append(arm)
        return {"import_s": self.SECONDS[arm] + extra, "process_s": self.SECONDS[arm] + 1, "modules": self.MODULES[arm]}


def test_main_interleaves_the_arms_and_prints_the_table(capsys):
    fake = _Fake()
    assert bench.main(["--rounds", "2"], measure=fake) == 0
    assert fake.calls == ["verl", "plugin", "task_runner", "task_runner", "plugin", "verl"]
    out = capsys.readouterr().out
    assert "| arm | what | runs | median s | min-max s | process s | modules |" in out
    assert "| plugin | `import verl` with the plugin | 2 | 4.50 | 4.25-4.75 | 5.25 | 3124 |" in out
    assert "plugin overhead (plugin - verl): +0.25 s median, +5 modules" in out
    assert "CPUs" in out and "load average" in out


def test_the_table_without_the_base_arm_has_no_overhead_line():
    rows = bench.summarise({"plugin": [{"import_s": 1.0, "process_s": 2.0, "modules": 10}]})
    assert [r["arm"] for r in rows] == ["plugin"] and "overhead" not in bench.table(rows)


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"], measure=_Fake())
