"""The CPU driver's per-step line and final list of files."""

from __future__ import annotations

from types import SimpleNamespace as NS

from populora_verl.local.progress import TINY_MODEL_NOTE, files_written, step_line


def test_step_line_counts_roles_ratings_and_evolution():
    samples = [NS(role="teacher", meta={"status": "valid"}), NS(role="teacher", meta={"status": "format_error"}),
               NS(role="student", meta={"correct": True, "source": "teacher"}),
               NS(role="student", meta={"correct": False, "source": "buffer"}),
               NS(role="student", meta={"correct": True, "source": "buffer"})]
    pop = NS(members=[NS(id="t0"), NS(id="s2")], ratings={"t0": NS(mu=1.0), "s2": NS(mu=30.0)})
    plan = NS(replacements=[NS(victim_id="s0", child_id="s2", operator="svd_mutation")])
    line = step_line(2, 5, NS(samples=samples), {"populora/rating/t0/mu": 21.25}, pop, plan)
    assert line == ("step 2/5 | teachers: 1/2 proposals valid | students: 2/3 solved (2 on buffer tasks) | "
                    "mu t0 21.2 s2 30.0 | evolved s0->s2 (svd_mutation)")
    assert step_line(1, 1, NS(samples=[]), {}, NS(members=[], ratings={}), None) == "step 1/1 | students: 0/0 solved | mu "


def test_files_written_lists_what_exists(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "ratings.png").write_bytes(b"png")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_3\n")
    lines = files_written(tmp_path)
    assert lines == [f"  {tmp_path / 'metrics.jsonl'}  (one JSON line per step)",
                     f"  {tmp_path / 'plots'}/  (ratings.png)",
                     f"  {tmp_path / 'checkpoints' / 'step_3'}  (latest checkpoint; PEFT folders under "
                     "population/adapters/)"]
    assert "expected" in TINY_MODEL_NOTE and "--model" in TINY_MODEL_NOTE
