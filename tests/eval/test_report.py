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


# --- 95% intervals ----------------------------------------------------------------------------------------------


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


# --- paired differences ----------------------------------------------------------------------------------------


def _comparison_results(*, baseline: bool = True) -> dict:
    """40 HumanEval+ and 40 GSM8K items. The baseline solves items 0-9, t0 items 0-29 and s0 items 0-25 (so the
    population wins on known items and never loses one); the base model solves items 30-39: as many as the
    baseline, on other items."""
    n = 40
    def o(first: int, last: int) -> list[int]:
        return [1 if first <= i <= last else 0 for i in range(n)]
    solved = {"base": o(30, 39), "single": o(0, 9), "t0": o(0, 29), "s0": o(0, 25)}
    roles = {"base": "base", "single": "baseline", "t0": "teacher", "s0": "student"}
    if not baseline:
        del solved["single"], roles["single"]
    benches = ["humaneval_plus", "gsm8k"]
    return {"format": "populora.eval/1", "benchmarks": benches, "limit": None,
            "members": [{"name": m, "adapter": None, "role": r} for m, r in roles.items()],
            "scores": {m: {b: {"pass@1": sum(x) / n, "n": n, "correct": sum(x), "outcomes": x} for b in benches}
                       for m, x in solved.items()}}


def test_paired_differences_points_and_intervals():
    from populora_verl.eval.report import paired_differences

    diffs = {d["name"]: d for d in paired_differences(_comparison_results())}
    assert list(diffs) == ["population mean - single (baseline)", "population max - single (baseline)",
                           "population mean - base", "single (baseline) - base"]
    mean_bl, max_bl = diffs["population mean - single (baseline)"], diffs["population max - single (baseline)"]
    assert (mean_bl["a"], mean_bl["b"]) == ("population mean", "single")
    for col in ("humaneval_plus", "gsm8k", "code_avg", "math_avg", "avg"):
        assert mean_bl["diff"][col] == pytest.approx((30 + 26) / 2 / 40 - 10 / 40)
        assert max_bl["diff"][col] == pytest.approx(30 / 40 - 10 / 40)
        assert diffs["single (baseline) - base"]["diff"][col] == pytest.approx(0.0)
        # A large difference won item by item: the paired interval holds the point and stays clear of 0, while the
        # members' own intervals (Wilson, 40 items) are each about +-14 points wide.
        for d in (mean_bl, max_bl, diffs["population mean - base"]):
            lo, hi = d["interval"][col]
            assert 0 < lo <= d["diff"][col] <= hi
        # Same score on different items: no difference, and the interval straddles 0.
        lo, hi = diffs["single (baseline) - base"]["interval"][col]
        assert lo < 0 < hi
    # The population max never drops below the population mean, draw by draw.
    assert max_bl["interval"]["avg"][0] >= mean_bl["interval"]["avg"][0]


def test_paired_differences_identical_members_and_missing_rows():
    from populora_verl.eval.report import paired_differences

    res = _comparison_results()
    res["scores"]["single"] = res["scores"]["t0"] = res["scores"]["s0"]  # every member answers alike
    d = {d["name"]: d for d in paired_differences(res)}["population mean - single (baseline)"]
    assert d["diff"]["avg"] == 0.0 and d["interval"]["avg"] == pytest.approx([0.0, 0.0])
    # No baseline: its pairs are skipped, the base comparison stays.
    assert [d["name"] for d in paired_differences(_comparison_results(baseline=False))] == ["population mean - base"]
    no_pop = _comparison_results()
    no_pop["members"] = [m for m in no_pop["members"] if m["name"] in ("base", "single")]
    assert [d["name"] for d in paired_differences(no_pop)] == ["single (baseline) - base"]
    # Older results without per-item outcomes: point differences, no intervals.
    old = {d["name"]: d for d in paired_differences(_results())}
    assert old["population mean - baseline"]["diff"]["humaneval_plus"] == pytest.approx(0.65 - 0.55)
    assert old["population mean - baseline"]["interval"] == {}


def test_paired_differences_in_eval_md_json_and_run_report(tmp_path):
    paths = write_table(_comparison_results(), tmp_path / "eval")
    md = paths["md"].read_text()
    head = "## Paired differences (percentage points, 95% paired bootstrap)"
    assert md.index("## With 95% intervals") < md.index(head)
    assert "| population mean - single (baseline) | +45.0 [+" in md and "Paired differences: the same" in md
    doc = json.loads(paths["json"].read_text())
    assert doc["differences"][1]["name"] == "population max - single (baseline)"
    assert doc["differences"][1]["diff"]["avg"] == pytest.approx(0.5)
    # populora-report --eval regenerates both eval.md and report.md with the section.
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "results.json").write_text(json.dumps(_comparison_results(baseline=False)))
    assert report_main([str(run), "--eval", str(tmp_path / "results.json"), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "### Paired differences (percentage points, 95% paired bootstrap)" in report
    assert "| population mean - base | +" in report and "single (baseline)" not in report
    assert head in (tmp_path / "rep" / "eval.md").read_text()
    # Nothing to compare: the section says so instead of an empty table.
    assert "No pair to compare" in write_table(_paired_results() | {"members": [
        {"name": "t0", "adapter": None, "role": "teacher"}]}, tmp_path / "alone")["md"].read_text()
