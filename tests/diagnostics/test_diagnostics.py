"""Diagnostics: program complexity, CVT coverage, metric keys, the metrics log and plots."""

from __future__ import annotations

import json
import logging
import re
import textwrap

import numpy as np
import pytest

from populora_verl.config import ConfigError, DiagnosticsConfig, load_config
from populora_verl.diagnostics import (
    CoverageArchive,
    MetricsLogger,
    ProblemDiagnostics,
    ProgramComplexity,
    complexities,
    complexity_metrics,
    coverage_metrics,
    descriptor_vector,
    evolution_metrics,
    merge_metrics,
    pair_metrics,
    plot_all,
    plot_coverage,
    plot_ratings,
    program_complexity,
    rating_metrics,
    read_metrics,
    reward_metrics,
    validity_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small_cfg(**kw) -> DiagnosticsConfig:
    kw.setdefault("cvt_cells", 16)
    kw.setdefault("cvt_samples", 400)
    return DiagnosticsConfig(**kw)


# --- complexity ------------------------------------------------------------------------------------------------

STRAIGHT = "def f(x):\n    return x + 1\n"

BRANCHY = textwrap.dedent('''
    def f(xs):
        """Docstring: not a line of code."""
        # a comment line
        total = 0

        for x in xs:
            if x > 0 and x % 2 == 0:
                total += x
            elif x < 0:
                total -= 1
        return total
''')

HELPERS = textwrap.dedent('''
    def g(a):
        return [i for i in range(a) if i % 3]

    def f(a, b):
        def inner(y):
            while y:
                y -= 1
            return y
        try:
            return g(a) + [inner(b)]
        except ValueError:
            return []

    class Box:
        def get(self, v):
            return v if v else 0
''')


def test_complexity_of_straight_line_program():
    c = program_complexity(STRAIGHT)
    # Module > FunctionDef > Return > BinOp > Name: 5 levels (arguments/arg is only 4 deep).
    assert c == ProgramComplexity(ast_depth=5, cyclomatic=1, loc=2, ast_nodes=8)
    # Token nodes (Load, Add) are not structure: `x = 1` is Module > Assign > Name.
    assert program_complexity("x = 1").ast_depth == 3


def test_complexity_of_branchy_program():
    c = program_complexity(BRANCHY)
    # 1 + for + if + `and` + elif = 5
    assert c.cyclomatic == 5
    # def, total = 0, for, if, total += x, elif, total -= 1, return: docstring, comment and blank excluded.
    assert c.loc == 8
    # Module > FunctionDef > For > If > BoolOp > Compare > BinOp(x % 2) > Name
    assert c.ast_depth == 8


def test_cyclomatic_is_summed_over_every_routine_including_closures_and_methods():
    c = program_complexity(HELPERS)
    g = 1 + 2  # comprehension + its if
    inner = 1 + 1  # while
    f = 1 + 1  # one except handler (radon does not count a closure's branches in its parent)
    get = 1 + 1  # conditional expression
    assert c.cyclomatic == g + inner + f + get
    # Summing, not max: adding a trivial helper adds 1.
    assert program_complexity(HELPERS + "\ndef h():\n    return 1\n").cyclomatic == c.cyclomatic + 1


def test_module_level_only_program_counts_its_body_as_one_routine():
    assert program_complexity("x = 1\nif x:\n    y = 2\n").cyclomatic == 2


@pytest.mark.parametrize("bad", [
    "def f(:\n    return",          # syntax error
    "def f(x):\nreturn x",          # indentation error
    "x = 1\x00",                    # NUL byte
    "(" * 300 + ")" * 300,          # too deeply nested for the parser
    "1+" * 30000 + "1",             # parses, but deeper than radon's recursion can walk
    None,
    b"def f(): pass",
])
def test_unparsable_input_returns_none(bad):
    assert program_complexity(bad) is None


def test_complexities_skips_and_counts_bad_programs_and_never_executes():
    side_effect = "import os\nos.system('touch /tmp/populora_pwned')\ndef f(x):\n    return x\n"
    measured, skipped = complexities([STRAIGHT, "def (", side_effect, "x = 1\n" * 40], max_chars=150)
    assert skipped == 2 and len(measured) == 2
    assert measured[1].loc == 4
    import os
    assert not os.path.exists("/tmp/populora_pwned")


# --- coverage --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def centroids():
    # k-means once for the module (a few seconds with ribs' import); the archives below reuse the centroids.
    return CoverageArchive(small_cfg(), seed=0).centroids


def P(depth, cc, loc):
    return ProgramComplexity(ast_depth=depth, cyclomatic=cc, loc=loc, ast_nodes=10)


def test_descriptor_vector_normalises_and_clips():
    v = descriptor_vector(P(10, 40, 30), ["ast_depth", "cyclomatic", "loc"],
                          {"ast_depth": 20, "cyclomatic": 20, "loc": 60})
    np.testing.assert_allclose(v, [0.5, 1.0, 0.5])
    with pytest.raises(ValueError, match="unknown descriptor"):
        descriptor_vector(P(1, 1, 1), ["halstead"], {"halstead": 1.0})


def test_coverage_grows_on_new_regions_and_not_on_repeats(centroids):
    cov = CoverageArchive(small_cfg(), centroids=centroids, window=2)
    assert cov.cells_filled == 0 and cov.num_cells == 16
    assert cov.add([P(1, 1, 1)], step=0) == 1
    # The same descriptor again, many times: nothing new.
    assert cov.add([P(1, 1, 1)] * 5, step=1) == 0
    assert cov.cells_filled == 1 and cov.counts.sum() == 6
    # The far corner of the cube is a different cell.
    assert cov.add([P(20, 20, 60)], step=2) == 1
    assert cov.cells_filled == 2 and cov.fraction == pytest.approx(2 / 16)
    # Clipping: beyond the bound is the same corner, not new coverage.
    assert cov.add([P(200, 99, 600)], step=3) == 0
    # Window of 2 steps at step 3 = steps {2, 3}: only the corner cell.
    assert cov.window_cells_filled() == 1
    cov.add([], step=10)
    assert cov.window_cells_filled() == 0 and cov.cells_filled == 2
    with pytest.raises(ValueError, match="backwards"):
        cov.add([P(1, 1, 1)], step=5)


def test_coverage_save_load_round_trip_continues_exactly(centroids, tmp_path):
    rng = np.random.default_rng(0)
    batches = [[P(*rng.integers(1, 25, size=3)) for _ in range(4)] for _ in range(8)]
    a = CoverageArchive(small_cfg(), centroids=centroids, window=3)
    for step, batch in enumerate(batches[:5]):
        a.add(batch, step)
    path = a.save(tmp_path / "ckpt" / "coverage.npz")
    b = CoverageArchive.load(path, small_cfg())
    assert b.cells_filled == a.cells_filled and b.window_cells_filled() == a.window_cells_filled()
    np.testing.assert_array_equal(b.centroids, a.centroids)
    np.testing.assert_array_equal(b.counts, a.counts)
    for step, batch in enumerate(batches[5:], start=5):
        assert a.add(batch, step) == b.add(batch, step)
        assert (a.cells_filled, a.window_cells_filled(), a.num_tasks) == \
               (b.cells_filled, b.window_cells_filled(), b.num_tasks)
    np.testing.assert_array_equal(b.counts, a.counts)
    # Loading under other descriptors would silently change what a cell means: refuse.
    with pytest.raises(ValueError, match="descriptors"):
        CoverageArchive.load(path, small_cfg(descriptors=["ast_depth", "loc"]))
    with pytest.raises(ValueError, match="descriptor_max"):
        CoverageArchive.load(path, small_cfg(descriptor_max={"ast_depth": 5.0, "cyclomatic": 20.0, "loc": 60.0}))


def test_problem_diagnostics_step_metrics_and_resume(centroids, tmp_path):
    cfg = small_cfg(coverage_window=2)
    diag = ProblemDiagnostics(cfg, archive=CoverageArchive(cfg, centroids=centroids))
    m = diag.observe([STRAIGHT, BRANCHY, "def ("], step=0)
    assert m["populora/complexity/num_programs"] == 2 and m["populora/complexity/unparsable"] == 1
    assert m["populora/complexity/cyclomatic/mean"] == pytest.approx((1 + 5) / 2)
    assert m["populora/coverage/cells_filled"] == m["populora/coverage/new_cells"] >= 1
    diag.save(tmp_path)
    resumed = ProblemDiagnostics.load(tmp_path, cfg)
    assert resumed.observe([HELPERS], step=1) == diag.observe([HELPERS], step=1)


def test_config_validates_descriptors_and_window():
    with pytest.raises(ConfigError, match="populora.diagnostics.descriptors"):
        load_config({"diagnostics": {"descriptors": ["halstead"]}})
    with pytest.raises(ConfigError, match="populora.diagnostics.coverage_window"):
        load_config({"diagnostics": {"coverage_window": 0}})
    cfg = load_config({"diagnostics": {"descriptors": ["ast_nodes", "loc"], "cvt_cells": 8}}).diagnostics
    assert cfg.descriptors == ["ast_nodes", "loc"]


# --- metric dicts ----------------------------------------------------------------------------------------------

CONTRACT_KEY = re.compile(
    r"^populora/("
    r"rating/[^/]+/(mu|sigma|conservative)"
    r"|pair/[^/]+/[^/]+/solve_rate"
    r"|validity/[^/]+"
    r"|complexity/(ast_depth|cyclomatic|loc|ast_nodes)/mean|complexity/(num_programs|unparsable)"
    r"|coverage/(cells_filled|fraction|window_cells_filled|window_fraction|new_cells)"
    r"|reward/[^/]+/mean|evolution/events)$")


def test_metric_builders_use_contract_keys_and_values():
    import trueskill

    ratings = rating_metrics({"t0": (25.0, 8.0), "s0": trueskill.Rating(mu=30.0, sigma=2.0)})
    assert ratings == {"populora/rating/t0/mu": 25.0, "populora/rating/t0/sigma": 8.0,
                       "populora/rating/t0/conservative": 1.0, "populora/rating/s0/mu": 30.0,
                       "populora/rating/s0/sigma": 2.0, "populora/rating/s0/conservative": 24.0}
    pairs = pair_metrics({("t0", "s0"): 0.25, ("t1", "s0"): 1.0})
    assert pairs == {"populora/pair/t0/s0/solve_rate": 0.25, "populora/pair/t1/s0/solve_rate": 1.0}
    validity = validity_metrics({"t0": (3, 4), "t1": (1, 4), "t2": (0, 0)})
    assert validity == {"populora/validity/t0": 0.75, "populora/validity/t1": 0.25, "populora/validity/mean": 0.5}
    cx = complexity_metrics([P(2, 1, 4), P(4, 3, 8)])
    assert cx["populora/complexity/ast_depth/mean"] == 3 and cx["populora/complexity/loc/mean"] == 6
    assert "populora/complexity/loc/mean" not in complexity_metrics([])
    cov = coverage_metrics(cells_filled=4, num_cells=16, window_cells_filled=2)
    assert cov["populora/coverage/fraction"] == 0.25 and cov["populora/coverage/window_fraction"] == 0.125
    rewards = reward_metrics({"t0": [1.0, -1.0, 0.5, 0.5], "s0": []})
    assert rewards == {"populora/reward/t0/mean": 0.25}
    merged = merge_metrics(ratings, pairs, validity, cx, cov, rewards, evolution_metrics(2))
    assert merged["populora/evolution/events"] == 2.0
    for key, value in merged.items():
        assert CONTRACT_KEY.match(key), key
        assert isinstance(value, float) or isinstance(value, int)
    with pytest.raises(ValueError, match="twice"):
        merge_metrics(pairs, pairs)


def test_metric_builders_reject_bad_input():
    with pytest.raises(ValueError, match="without '/'"):
        pair_metrics({("t/0", "s0"): 0.5})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pair_metrics({("t0", "s0"): 1.5})
    with pytest.raises(ValueError, match="finite"):
        rating_metrics({"t0": (float("nan"), 1.0)})
    with pytest.raises(ValueError, match="valid <= proposals"):
        validity_metrics({"t0": (5, 4)})


def test_rating_metrics_accepts_population_ratings_object():
    Ratings = pytest.importorskip("populora_verl.population.ratings").Ratings
    r = Ratings()
    r.add("t0")
    r.add("s0")
    r.rate_game("t0", "s0", "student")
    assert rating_metrics(r) == pytest.approx(r.metrics())


# --- metrics log -----------------------------------------------------------------------------------------------


def test_metrics_logger_writes_flushed_jsonl_and_reader_tolerates_truncation(tmp_path, caplog):
    logger = MetricsLogger(tmp_path)
    logger.log({"populora/validity/mean": 0.5, "populora/bad": float("nan")}, step=0)
    # Flushed per step: readable before close.
    assert read_metrics(tmp_path) == [{"step": 0, "populora/validity/mean": 0.5}]
    logger.log({"populora/validity/mean": 0.75}, step=1)
    logger.close()
    path = tmp_path / "metrics.jsonl"
    # A killed run: half of a third line.
    with open(path, "a") as fh:
        fh.write('{"step": 2, "populora/validity/me')
    with caplog.at_level(logging.INFO):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [0, 1]
    # Corruption in the middle is not silently skipped.
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "{oops", lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_metrics(bad)
    # Re-opening (resume from the checkpoint of step 0) cuts the partial line and the rows after step 0.
    with MetricsLogger(tmp_path, resume_step=0) as resumed:
        resumed.log({"populora/validity/mean": 1.0}, step=1)
    assert [json.loads(l) for l in path.read_text().splitlines()] == [
        {"step": 0, "populora/validity/mean": 0.5}, {"step": 1, "populora/validity/mean": 1.0}]
    with pytest.raises(ValueError, match="reserved"):
        MetricsLogger(tmp_path).log({"step": 3}, step=3)


def test_metrics_logger_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log({"populora/coverage/fraction": 0.1}, step=0)
        logger.log({"populora/coverage/fraction": 0.2}, step=1)
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    values = [e.value for e in acc.Scalars("populora/coverage/fraction")]
    assert values == pytest.approx([0.1, 0.2])


# --- plots -----------------------------------------------------------------------------------------------------


def synthetic_log(run_dir, steps=12):
    rng = np.random.default_rng(1)
    with MetricsLogger(run_dir) as logger:
        for step in range(steps):
            data = merge_metrics(
                rating_metrics({m: (25 + rng.normal(), 8.0 - 0.4 * step) for m in ("t0", "t1", "s0", "s1")}),
                pair_metrics({(t, s): float(rng.uniform()) for t in ("t0", "t1") for s in ("s0", "s1")}),
                validity_metrics({"t0": (int(rng.integers(0, 5)), 4), "t1": (3, 4)}),
                complexity_metrics([P(int(d), 2, 5) for d in rng.integers(2, 10, size=3)]),
                coverage_metrics(cells_filled=min(16, 2 + step), num_cells=16, window_cells_filled=2),
            )
            logger.log(data, step=step)
    return run_dir / "metrics.jsonl"


def test_plot_all_writes_png_files(tmp_path):
    path = synthetic_log(tmp_path)
    written = plot_all(path, tmp_path / "plots")
    assert sorted(p.name for p in written) == sorted(
        ["solve_rates.png", "validity.png", "complexity.png", "coverage.png", "ratings.png"])
    for p in written:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, p


def test_missing_keys_skip_plots_with_a_note(tmp_path, caplog):
    with MetricsLogger(tmp_path) as logger:
        for step in range(3):
            logger.log(coverage_metrics(cells_filled=step + 1, num_cells=8), step=step)
    with caplog.at_level(logging.INFO, logger="populora_verl.diagnostics.plots"):
        written = plot_all(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert [p.name for p in written] == ["coverage.png"]
    assert "plot ratings skipped" in caplog.text
    assert plot_ratings(read_metrics(tmp_path), tmp_path / "r.png") is None
    assert plot_coverage(read_metrics(tmp_path), tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


def test_plots_cli(tmp_path):
    from populora_verl.diagnostics.plots import main

    synthetic_log(tmp_path, steps=3)
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "ratings.png").read_bytes()[:8] == PNG_MAGIC


# --- plots a person reads at a glance, and runs compared -------------------------------------------------------


def _events_log(run_dir, plans):
    with open(run_dir / "evolution.jsonl", "w") as f:
        for step, reps in plans:
            f.write(json.dumps({"step": step, "replacements": [
                {"victim_id": v, "child_id": c, "operator": op, "parent_ids": [p]} for v, c, op, p in reps]}) + "\n")
        f.write('{"step": 9, "replacem')  # a half-written last line is skipped, not fatal


def _lines(fig_axes):
    return [ln for ln in fig_axes.get_lines()]


def test_read_events_from_log_and_lineage(tmp_path):
    from populora_verl.diagnostics.plots import events_from_metrics, read_events

    _events_log(tmp_path, [(3, [("t1", "t2", "neftune", "t0"), ("s0", "s2", "full_gaussian", "s1")])])
    events = read_events(tmp_path)
    assert [(e.step, e.child, e.operator, e.parents) for e in events] == [
        (3, "t2", "neftune", ("t0",)), (3, "s2", "full_gaussian", ("s1",))]
    assert events[0].label == "t2 = neftune(t0)"
    # Without evolution.jsonl (verl trainer): the lineage of the latest population checkpoint.
    verl = tmp_path / "verl" / "global_step_4" / "populora" / "checkpoints" / "step_4" / "population"
    verl.mkdir(parents=True)
    (verl / "population.json").write_text(json.dumps({"lineage": [
        {"id": "t0", "role": "teacher", "parents": [], "birth_step": 0},
        {"id": "t1", "role": "teacher", "parents": ["t0"], "operator": "ties", "birth_step": 2}]}))
    assert [(e.step, e.child, e.operator) for e in read_events(tmp_path / "verl")] == [(2, "t1", "ties")]
    assert read_events(tmp_path / "nowhere") == []
    rows = [{"step": 1, "populora/evolution/events": 0.0}, {"step": 2, "populora/evolution/events": 2.0}]
    assert [(e.step, e.label) for e in events_from_metrics(rows)] == [(2, "2 replaced")]


def test_ratings_plot_integer_steps_markers_one_step_child_and_events(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from populora_verl.diagnostics import plots

    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3, 4):
            ids = ("t0", "t1") if step < 4 else ("t0", "t2")  # t2 is born after step 3 and rated once
            logger.log(rating_metrics({m: (20.0 + step, 5.0) for m in ids}), step=step)
    _events_log(tmp_path, [(3, [("t1", "t2", "neftune", "t0")])])
    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or path)
    plots.plot_all(tmp_path / "metrics.jsonl", tmp_path / "plots")
    fig = saved[[i for i, f in enumerate(saved) if f.axes[0].get_title().startswith("TrueSkill")][0]]
    ax = fig.axes[0]
    assert isinstance(fig, Figure)
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    member_lines = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_label() in ("t0", "t1", "t2")}
    # t2 ties t0 at step 4, so the two are drawn a fraction of a step apart
    assert [round(x) for x in member_lines["t2"].get_xdata()] == [4] and member_lines["t2"].get_marker() not in (None, "None", "")
    vlines = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [3.5, 3.5]]
    assert len(vlines) == 1
    assert any("t2 = neftune(t0)" in t.get_text() for t in ax.texts)


def test_compare_runs_draws_every_run_on_shared_axes(tmp_path, monkeypatch):
    from populora_verl.diagnostics import plots

    runs = []
    for name, members in (("single", ("a0",)), ("pop", ("t0", "t1", "s0", "s1"))):
        run = tmp_path / name
        with MetricsLogger(run) as logger:
            for step in range(1, 5):
                logger.log({**rating_metrics({m: (25.0, 8.0 - step) for m in members}),
                            **validity_metrics({members[0]: (step, 4)}),
                            "populora/task_type/code_o/validity": step / 4, "populora/student/accuracy": 0.1 * step,
                            **complexity_metrics([P(step, 2, 5)]),
                            **coverage_metrics(cells_filled=step, num_cells=8, window_cells_filled=1),
                            "populora/role/teacher/reward_mean": 0.5, "populora/role/student/reward_mean": 0.2,
                            "populora/role/teacher/response_length_mean": 100.0 + step,
                            "populora/role/student/response_length_mean": 50.0,
                            "populora/role/teacher/format_error_rate": 1.0 / step,
                            "populora/role/student/format_error_rate": 0.5 / step}, step=step)
        runs.append(run)
    _events_log(runs[1], [(2, [("t1", "t2", "neftune", "t0")])])
    saved = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.setdefault(path.name, fig) and path)
    written = plots.compare_runs(runs, tmp_path / "cmp")
    assert sorted(p.name for p in written) == sorted(
        ["solve_rate.png", "validity.png", "complexity.png", "coverage.png", "ratings.png", "response_length.png",
         "format_error.png", "reward.png"])
    for name in ("solve_rate.png", "coverage.png", "reward.png", "response_length.png", "format_error.png"):
        for ax in saved[name].axes:
            labels = [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]
            assert labels == ["single", "pop"], (name, labels)
    assert [ax.get_title() for ax in saved["validity.png"].axes] == [
        "Valid proposals: all types", "Valid proposals: code_o"]
    assert [ax.get_title().split(": ")[1] for ax in saved["complexity.png"].axes] == ["ast_depth", "cyclomatic", "loc"]
    fmt = saved["format_error.png"].axes
    assert [ax.get_title() for ax in fmt] == ["Format errors (answer envelope): teacher",
                                              "Format errors (answer envelope): student"]
    assert list(fmt[0].get_lines()[0].get_ydata()) == [1.0, 0.5, 1 / 3, 0.25]
    titles = [ax.get_title() for ax in saved["ratings.png"].axes]
    assert titles[0].startswith("TrueSkill rating (teachers)") and titles[-1].startswith("TrueSkill rating (members)")
    assert any("pop: t2 = neftune(t0)" in t.get_text() for t in saved["ratings.png"].axes[0].texts)
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plots.compare_runs([tmp_path / "missing"], tmp_path / "cmp")


def test_report_compare_cli_writes_figures_and_summary(tmp_path):
    from populora_verl.eval.cli import report_main

    for name in ("a", "b"):
        synthetic_log(tmp_path / name, steps=4)
    out = tmp_path / "cmp"
    assert report_main(["--compare", str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "A", "B",
                        "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "| A | 3 |" in md and "| B | 3 |" in md and "![ratings](ratings.png)" in md
    assert (out / "ratings.png").read_bytes()[:8] == PNG_MAGIC


def test_report_compare_missing_run_is_one_line(tmp_path, capsys):
    from populora_verl.eval.cli import report_main

    assert report_main(["--compare", str(tmp_path / "nope"), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"populora-report: error: --compare {tmp_path / 'nope'}: no such directory"
    (tmp_path / "empty").mkdir()
    assert report_main(["--compare", str(tmp_path / "empty"), "--out", str(tmp_path / "cmp")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"populora-report: error: {tmp_path / 'empty'}: no metrics.jsonl (--debug shows the traceback)"


def _captured_figure(monkeypatch):
    import populora_verl.diagnostics.plots as P

    figs = []
    monkeypatch.setattr(P, "_save", lambda fig, out: figs.append(fig) or out)
    return figs


def test_tied_members_stay_visible_in_ratings(tmp_path, monkeypatch):
    """Founders share a rating until their first game: each tied member is drawn beside the other, not under it."""
    from populora_verl.diagnostics.plots import plot_ratings

    rows = [{"step": s, "populora/rating/t0/mu": 20.0, "populora/rating/t0/sigma": 6.0,
             "populora/rating/t1/mu": 20.0 if s == 1 else 21.0, "populora/rating/t1/sigma": 6.0,
             "populora/rating/t2/mu": 25.0, "populora/rating/t2/sigma": 6.0} for s in (1, 2)]
    figs = _captured_figure(monkeypatch)
    plot_ratings(rows, tmp_path / "r.png")
    lines = {ln.get_label(): ln for ln in figs[0].axes[0].get_lines()}
    x0, x1, x2 = (list(lines[m].get_xdata()) for m in ("t0", "t1", "t2"))
    assert x0[0] != x1[0] and abs(x0[0] - x1[0]) < 0.5  # side by side, within the step
    assert lines["t0"].get_linestyle() != lines["t1"].get_linestyle()
    assert x2 == [1.0, 2.0]  # a member tied with nobody stays on its step


def test_solve_rate_title_says_what_is_drawn(tmp_path, monkeypatch):
    from populora_verl.diagnostics.plots import plot_solve_rates

    figs = _captured_figure(monkeypatch)
    plot_solve_rates([{"step": 1, "populora/student/accuracy": 0.0}], tmp_path / "a.png")
    assert "per (teacher, student) pair" not in figs[-1].axes[0].get_title()
    assert "all answers" in figs[-1].axes[0].get_title()
    plot_solve_rates([{"step": 1, "populora/student/accuracy": 0.5, "populora/pair/t0/s0/solve_rate": 0.5}],
                     tmp_path / "b.png")
    assert figs[-1].axes[0].get_title() == "Student solve rate per (teacher, student) pair"


def test_plots_cli_errors_are_one_line(tmp_path, capsys):
    from populora_verl.diagnostics.plots import main

    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (f"populora_verl.diagnostics.plots: error: run {tmp_path / 'nope'}: no "
                                               "such run directory or metrics file")
    synthetic_log(tmp_path, steps=2)
    (tmp_path / "f").write_text("x")
    assert main([str(tmp_path), "--out", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--out {tmp_path / 'f'}: is a file, not a folder")
