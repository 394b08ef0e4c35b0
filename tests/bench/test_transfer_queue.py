"""The TransferQueue benchmark: settings alternate, the table compares them with the first, a failed measurement
says why, and one real measurement (a tiny batch through a real local Ray cluster) goes end to end."""

from __future__ import annotations

import pytest

from populora_verl.bench import child
from populora_verl.bench import transfer_queue as tqb

from _shared import compose_recipe


def test_settings_alternate_and_the_table_is_relative_to_the_first(capsys):
    order = []

    def fake(units, args):
        order.append(units)
        return {"init_s": 2.0 * units, "put_s": 0.1, "get_s": 0.1 * units, "mb": 59.0}

    assert tqb.main(["--units", "8", "2", "--rounds", "3"], measure=fake) == 0
    assert order == [8, 2, 2, 8, 8, 2]
    out = capsys.readouterr().out
    assert "| 8 | 16.0 (16.0-16.0) | 0.90 (0.90-0.90) | 1.00 | 1.00 |" in out
    assert "| 2 | 4.0 (4.0-4.0) | 0.30 (0.30-0.30) | 0.25 | 0.33 |" in out


@pytest.mark.parametrize("argv", [["--units", "2", "2"], ["--units", "0"], ["--rounds", "0"]])
def test_bad_arguments_stop_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tqb.main(argv, measure=lambda *a: pytest.fail("no measurement may run"))
    assert e.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_a_failed_measurement_says_why(monkeypatch):
    class Done:
        returncode, stdout, stderr = 1, "", "ValueError: no storage backend"

    monkeypatch.setattr(child.subprocess, "run", lambda cmd, **kw: Done())
    args = type("A", (), {"samples": 4, "tokens": 8, "timeout_s": 5})()
    with pytest.raises(RuntimeError, match=r"with 2 storage unit\(s\) failed with exit status 1:\n.*no storage"):
        tqb.run_child(2, args)


def test_one_real_measurement_through_a_local_ray_cluster(ray_tmpdir, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir)
    # No time limit: the measurement ends when its child does, however loaded the machine is (17-55 s on 2 cores).
    args = type("A", (), {"samples": 4, "tokens": 8, "timeout_s": None})()
    t = tqb.run_child(1, args)
    assert t["init_s"] > 0 and t["put_s"] >= 0 and t["get_s"] >= 0
    assert t["mb"] == pytest.approx(4 * 8 * (8 + 8 + 4 + 4) / 1e6)


def test_recipes_run_transfer_queue_with_its_own_default_of_two_units():
    cfg = compose_recipe("qwen1.5b_4gpu_4t4s", ["actor_rollout_ref.model.path=/m"])
    assert cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units == 2
