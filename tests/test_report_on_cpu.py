"""Population report: the member x benchmark table and the run report from a synthetic run directory."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from populora_verl.eval.cli import report_main
from populora_verl.eval.report import (
    build_run_report,
    find_population_dir,
    markdown_table,
    population_table,
    write_table,
)


def _results() -> dict:
    scores = {
        "base": {"humaneval_plus": 0.50, "mbpp_plus": 0.60, "gsm8k": 0.70, "aime24": 0.10},
        "baseline": {"humaneval_plus": 0.55, "mbpp_plus": 0.62, "gsm8k": 0.72, "aime24": 0.10},
        "t0": {"humaneval_plus": 0.60, "mbpp_plus": 0.64, "gsm8k": 0.74, "aime24": 0.20},
        "s0": {"humaneval_plus": 0.70, "mbpp_plus": 0.60, "gsm8k": 0.80, "aime24": 0.00},
    }
    roles = {"base": "base", "baseline": "baseline", "t0": "teacher", "s0": "student"}
    return {"format": "populora.eval/1", "benchmarks": ["humaneval_plus", "mbpp_plus", "gsm8k", "aime24"],
            "limit": None, "members": [{"name": n, "adapter": None, "role": r} for n, r in roles.items()],
            "scores": {m: {b: {"pass@1": v, "n": 10, "correct": round(10 * v)} for b, v in s.items()}
                       for m, s in scores.items()}}


def test_population_table_stats_and_averages():
    table = population_table(_results())
    rows = {r["name"]: r for r in table["rows"]}
    assert table["columns"][-3:] == ["code_avg", "math_avg", "avg"]
    assert rows["t0"]["code_avg"] == pytest.approx(0.62) and rows["t0"]["math_avg"] == pytest.approx(0.47)
    assert rows["t0"]["avg"] == pytest.approx((0.62 + 0.47) / 2)
    # Population statistics cover members only, column by column.
    assert rows["population mean"]["humaneval_plus"] == pytest.approx(0.65)
    assert rows["population min"]["aime24"] == 0.0 and rows["population max"]["gsm8k"] == pytest.approx(0.80)
    assert rows["population min"]["avg"] == pytest.approx(min(rows["t0"]["avg"], rows["s0"]["avg"]))
    assert rows["teachers mean"]["humaneval_plus"] == pytest.approx(0.60)
    assert [r["kind"] for r in table["rows"][:2]] == ["base", "baseline"]
    md = markdown_table(table)
    assert "| **population mean** |" in md and "65.0" in md and "HumanEval+" in md and "Math avg" in md


def test_write_table_md_csv_json(tmp_path):
    paths = write_table(_results(), tmp_path)
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert {r["model"] for r in rows} >= {"base", "baseline", "t0", "s0", "population mean"}
    assert float(next(r for r in rows if r["model"] == "s0")["humaneval_plus"]) == pytest.approx(0.7)
    doc = json.loads(paths["json"].read_text())
    assert doc["table"]["columns"][0] == "humaneval_plus" and doc["results"]["scores"]["t0"]
    assert "Code avg = mean of HumanEval+" in paths["md"].read_text()


def _synthetic_run(run: Path, steps: int = 6) -> None:
    """metrics.jsonl and a population save laid out as docs/CONTRACTS.md describes."""
    ids = ["t0", "t1", "s0", "s1"]
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step}
            alive = ["t0", "t2" if step > 3 else "t1", "s0", "s1"]
            for k, mid in enumerate(alive):
                row[f"populora/rating/{mid}/mu"] = 25.0 + k + 0.3 * step
                row[f"populora/rating/{mid}/sigma"] = 8.0 - 0.5 * step
                row[f"populora/rating/{mid}/conservative"] = row[f"populora/rating/{mid}/mu"] - 3 * row[
                    f"populora/rating/{mid}/sigma"]
            for t in alive[:2]:
                for s in ("s0", "s1"):
                    row[f"populora/pair/{t}/{s}/solve_rate"] = (step % 4) / 4
                row[f"populora/validity/{t}"] = 0.5 + 0.05 * step
            row["populora/validity/mean"] = 0.5 + 0.05 * step
            for d in ("ast_depth", "cyclomatic", "loc"):
                row[f"populora/complexity/{d}/mean"] = 2.0 + step
            row["populora/coverage/cells_filled"] = 3 * step
            row["populora/coverage/fraction"] = 3 * step / 64
            row["populora/evolution/events"] = 1 if step == 4 else 0
            f.write(json.dumps(row) + "\n")
    lineage = [{"id": i, "role": "teacher" if i[0] == "t" else "student", "slot": n, "parents": [],
                "operator": None, "birth_step": 0, "generation": 0, "death_step": 3 if i == "t1" else None,
                "final_mu": None, "final_sigma": None} for n, i in enumerate(ids)]
    lineage.append({"id": "t2", "role": "teacher", "slot": 1, "parents": ["t0", "t1"], "operator": "dare_crossover",
                    "birth_step": 3, "generation": 1, "death_step": None, "final_mu": None, "final_sigma": None})
    pop = run / "checkpoints" / "step_6" / "population"
    pop.mkdir(parents=True)
    ratings = {"env": {}, "ratings": {"t0": [27.0, 5.0], "t2": [26.0, 6.0], "s0": [29.0, 4.0], "s1": [30.0, 4.5]}}
    (pop / "population.json").write_text(json.dumps({"format": "populora.population/1", "lineage": lineage,
                                                     "ratings": ratings}))
    (run / "checkpoints" / "latest").write_text("6\n")


def test_run_report_from_synthetic_run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _synthetic_run(run)
    (run / "eval").mkdir()
    (run / "eval" / "results.json").write_text(json.dumps(_results()))
    assert find_population_dir(run) == run / "checkpoints" / "step_6" / "population"
    rc = report_main([str(run)])
    assert rc == 0
    out = run / "report"
    text = (out / "report.md").read_text()
    assert "## Evaluation" in text and "**population mean**" in text
    assert "## Training dynamics" in text and "6 logged steps" in text
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert len(pngs) >= 4, pngs
    for name in pngs:
        assert f"plots/{name}" in text
    assert (out / "lineage.png").stat().st_size > 5000
    assert "| t2 | teacher | t0, t1 | dare_crossover | 3 | - |" in text
    assert "| t1 | teacher | - | - | 0 | 3 |" in text
    assert "Final TrueSkill ratings" in text
    assert "| t2 | 26.00 | 6.00 | 8.00 | alive |" in text  # the checkpoint's rating, not the last logged one
    assert "| t1 | " in text and "replaced at step 3 (last logged rating)" in text
    assert (out / "eval.csv").is_file()


def test_run_report_without_eval_or_population(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    report = build_run_report(run)
    text = report.read_text()
    assert "No evaluation results" in text and "No metrics.jsonl" in text and "No population.json" in text
    with pytest.raises(FileNotFoundError):
        build_run_report(tmp_path / "missing")


# --- 95% intervals (issue 13 item 3) ---------------------------------------------------------------------------


def _paired_results() -> dict:
    """Two members with complementary outcomes on 20 HumanEval+ items: their mean is 0.5 on every resample."""
    a = [1] * 10 + [0] * 10
    b = [0] * 10 + [1] * 10
    base = [1] * 5 + [0] * 15
    def sc(o):
        return {"humaneval_plus": {"pass@1": sum(o) / len(o), "n": len(o), "correct": sum(o), "outcomes": o}}
    return {"format": "populora.eval/1", "benchmarks": ["humaneval_plus"], "limit": None,
            "members": [{"name": "base", "adapter": None, "role": "base"},
                        {"name": "t0", "adapter": None, "role": "teacher"},
                        {"name": "s0", "adapter": None, "role": "student"}],
            "scores": {"base": sc(base), "t0": sc(a), "s0": sc(b)}}


def test_wilson_interval_matches_the_closed_form():
    from populora_verl.eval.report import wilson_interval

    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_intervals_members_wilson_population_paired_bootstrap():
    from populora_verl.eval.report import table_intervals, wilson_interval

    res = _paired_results()
    ci = table_intervals(res)
    assert ci["t0"]["humaneval_plus"] == pytest.approx(wilson_interval(10, 20))
    assert ci["base"]["humaneval_plus"] == pytest.approx(wilson_interval(5, 20))
    # Paired resampling: the two members always average 0.5, so the population mean has no spread.
    assert ci["population mean"]["humaneval_plus"] == pytest.approx((0.5, 0.5))
    lo, hi = ci["population max"]["humaneval_plus"]
    assert 0.5 <= lo < hi <= 1.0  # the best member is re-chosen on every resample: never below the mean
    assert ci["population min"]["humaneval_plus"][1] <= 0.5
    assert ci["teachers mean"]["humaneval_plus"][0] < 0.5 < ci["teachers mean"]["humaneval_plus"][1]
    assert ci["t0"]["code_avg"][0] < 0.5 < ci["t0"]["code_avg"][1]  # an average: bootstrap


def test_interval_table_in_eval_files_and_older_results(tmp_path):
    from populora_verl.eval.report import markdown_interval_table

    paths = write_table(_paired_results(), tmp_path)
    md = paths["md"].read_text()
    assert "## With 95% intervals" in md and "| **population mean** |  | 50.0 [50.0, 50.0] |" in md
    assert json.loads(paths["json"].read_text())["intervals"]["t0"]["humaneval_plus"][0] > 0.25
    # Results without per-item outcomes (older files): Wilson intervals for members, plain numbers otherwise.
    old = markdown_interval_table(_results())
    assert "| t0 | teacher | 60.0 [" in old and "| **population mean** |  | 65.0 |" in old


def test_summarize_keeps_per_item_outcomes():
    from populora_verl.eval.backends import Member
    from populora_verl.eval.evaluate import summarize

    recs = [{"member": "m", "benchmark": "humaneval_plus", "id": str(i), "correct": c} for i, c in
            enumerate([True, False, True])]
    s = summarize(recs, [Member("m")], ["humaneval_plus"])["m"]["humaneval_plus"]
    assert s["outcomes"] == [1, 0, 1] and s["correct"] == 2 and s["n"] == 3
