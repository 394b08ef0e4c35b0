"""The learning run's analysis tools on synthetic runs: the dynamics summary (windows, slope interval, direction
changes, compute, executor share) and the per-arm paired evaluation differences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from populora_verl.diagnostics import dynamics as dyn
from populora_verl.eval import arms


def _write_run(tmp_path, slope: float, steps: int = 20, name: str = "single-seed1", seed: int = 0):
    run = tmp_path / name
    run.mkdir()
    rng = np.random.default_rng(seed)
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({
                "step": s, "populora/validity/mean": s / steps,
                "populora/role/teacher/format_error_rate": 1 - s / steps,
                "populora/complexity/cyclomatic/mean": 3.0 + slope * s + 0.01 * rng.standard_normal(),
                "populora/complexity/loc/mean": 10.0 + 0.01 * rng.standard_normal(),
                "populora/complexity/num_programs": 3.0, "populora/coverage/cells_filled": float(min(s, 7)),
                "populora/pair/t0/s0/solve_rate": 0.2 if s % 2 else 0.6,  # flips direction every step
                "populora/task_type/code_f/validity": 0.0, "populora/task_type/code_f/fail/input_count": 1.0,
                "populora/task_type/code_f/fail/blocks": 0.0,
                "populora/compute/t0/trajectories": 20.0, "populora/compute/s0/trajectories": 40.0,
                "populora/compute/member_mean/trajectories": 30.0, "populora/compute/planned_trajectories": 30.0,
                # steps 7 and 8 starve s1 (the matchmaking defect's signature) and put it 100 % off its plan
                "populora/compute/s1/trajectories": 0.0 if s in (7, 8) else 40.0,
                "populora/compute/max_plan_deviation": 1.0 if s in (7, 8) else 0.05,
            }) + "\n")
        f.write('{"step": 21, "populora/validity')  # a line cut by a killed run is skipped
    with open(run / "verl_metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "data": {"timing_s/step": 20.0, "timing_s/populora_validate": 0.3,
                                                     "timing_s/populora_score": 0.1}}) + "\n")
    (run / "evolution.jsonl").write_text(json.dumps({"step": 5, "replacements": [
        {"victim_id": "t1", "child_id": "t2", "operator": "neftune", "parent_ids": ["t0"], "tie_break": True}]}) + "\n")
    return run


def test_dynamics_summary_reads_what_was_logged(tmp_path):
    s = dyn.summarise(dyn.load_run(_write_run(tmp_path, slope=-0.05)))
    assert s["steps"] == 20
    first, last = s["learning"]["validity (programs, AZR)"]
    assert first == pytest.approx(np.mean([1, 2, 3, 4, 5]) / 20) and last == pytest.approx(np.mean(range(16, 21)) / 20)
    slope, lo, hi = s["complexity"]["slope"]
    assert slope == pytest.approx(-0.05, abs=0.005) and lo < slope < hi < 0  # a clear fall: interval below 0
    assert s["pairs"]["t0->s0"]["sign_changes"] == (18, 19)  # changes direction at every chance
    assert s["per_type"]["code_f"]["no task, by reason (run mean)"] == {"input_count": 1.0}  # zero reasons dropped
    assert s["compute"]["per_member_total"] == {"s0": 800.0, "s1": 720.0, "t0": 400.0}
    assert s["compute"]["steps_with_an_idle_member"] == [7, 8] and s["compute"]["steps_off_plan"] == 2
    assert s["speed"]["executor_share_median"] == pytest.approx(0.02)
    text = dyn.markdown(s)
    assert "[tie-break]" in text and "slope -0.05" in text and "2.0 % of the step" in text
    assert "2 of 20 steps with an adapter more than 10 % off its plan (largest deviation 100%)" in text
    assert "a member trained nothing on 2 steps" in text
    (tmp_path / "b").mkdir()
    flat = dyn.summarise(dyn.load_run(_write_run(tmp_path / "b", slope=0.0)))
    _, lo, hi = flat["complexity"]["slope"]
    assert lo < 0 < hi  # no trend: the interval straddles 0


def test_dynamics_cli_errors_in_one_line(tmp_path, capsys):
    assert dyn.main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert dyn.slope_interval(np.array([1.0, 1.0, 1.0, 1.0]), np.array([1.0, 2.0, 3.0, 4.0])) is None
    assert dyn.sign_changes([1, 2, 3, 4]) == (0, 3)


def test_arms_side_by_side_difference_and_oscillation(tmp_path, capsys):
    runs = [_write_run(tmp_path, -0.05, name="single-seed1", seed=1), _write_run(tmp_path, -0.03, name="single-seed2",
            seed=2), _write_run(tmp_path, 0.04, name="2t2s-seed1", seed=3), _write_run(tmp_path, 0.06, name="2t2s-seed2",
            seed=4)]
    cmp = dyn.compare_arms([dyn.load_run(r) for r in runs])
    assert list(cmp["arms"]) == ["single", "2t2s"]  # seeds grouped by folder name, in order
    single = cmp["arms"]["single"]
    assert single["seeds"] == ["single-seed1", "single-seed2"]
    assert single["valid_programs"] == [60.0, 60.0] and single["cells_filled_last"] == [7.0, 7.0]
    diff, lo, hi = cmp["differences"]["2t2s - single"]["cyclomatic"]
    assert diff == pytest.approx(0.09, abs=0.005) and 0 < lo < diff < hi  # +0.05 - (-0.04)
    _, lo, hi = cmp["differences"]["2t2s - single"]["loc"]
    assert lo < 0 < hi  # length flat in every seed: no difference
    # every pair series alternates 0.2 / 0.6: two levels change direction at every chance whatever their order, so
    # shuffling in time gives the same rate and the test does not call it oscillation
    assert single["direction_changes"] == (36, 36) and single["direction_changes_noise_p"] == 1.0
    # two seeds an arm: 6 relabellings, and the observed split is one of the 2 extreme ones
    assert cmp["differences"]["2t2s - single"]["seed_p"]["cyclomatic_slope"] == pytest.approx(2 / 6)
    assert cmp["differences"]["2t2s - single"]["seed_p"]["cells_filled_last"] == 1.0  # equal cells in every seed
    assert dyn.main([*map(str, runs), "--compare"]) == 0
    out = capsys.readouterr().out
    assert "### Arms side by side" in out and "cyclomatic slope p = 0.33" in out


def test_seed_permutation_p_is_exact_over_relabellings():
    # 4 + 4 seeds, fully separated: only the observed split and its mirror are as extreme, 2 of C(8, 4) = 70
    assert dyn.seed_permutation_p([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(2 / 70)
    assert dyn.seed_permutation_p([1, 5, 3, 7], [2, 6, 4, 8]) > 0.5  # interleaved: most relabellings differ more
    assert dyn.seed_permutation_p([1, None, 2], [3, 4]) == pytest.approx(2 / 6)  # a seed without a value is left out
    assert dyn.seed_permutation_p([1], [2, 3]) is None  # one seed: nothing to permute


def test_oscillation_test_keeps_each_series_values():
    up_down = [0.1, 0.5, 0.2, 0.6, 0.3, 0.7, 0.4, 0.8, 0.1, 0.9, 0.2, 0.5]  # many levels, up and down every step
    ch, _ = dyn.sign_changes(up_down)
    assert ch == 10 and dyn.noise_p_value([up_down]) < 0.05
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert dyn.noise_p_value([rising]) == 1.0  # no change at all: every shuffle has at least as many
    assert dyn.noise_p_value([[0.5, 0.5, 0.5]]) is None  # no chance to change direction
    assert dyn.slope_difference([], [(np.arange(5.0), np.arange(5.0))]) is None


def _results(path, bench, members):
    path.write_text(json.dumps({"scores": {m: {bench: {"outcomes": list(v)}} for m, v in members.items()}}))
    return path


def test_arm_differences_pair_items_and_average_members(tmp_path):
    n = 200
    base = np.zeros(n)
    better = np.zeros(n)
    better[:20] = 1  # +10 points, on the same items every draw
    a = _results(tmp_path / "a.json", "humaneval_plus", {"base": base, "pop@10.t0": better, "pop@10.s0": base,
                                                          "single@40.a0": base})
    b = _results(tmp_path / "b.json", "mbpp_plus", {"base": base, "pop@10.t0": base, "pop@10.s0": base,
                                                     "single@40.a0": base})
    scores = arms.arm_scores(arms.load_outcomes([a, b]))
    assert set(scores["humaneval_plus"]) == {"base", "pop", "single"}
    d = arms.paired_difference(scores, "pop", "base")
    assert d["humaneval_plus"][0] == pytest.approx(0.05)  # the mean of two members: +10 and 0
    assert d["mbpp_plus"] == (0.0, 0.0, 0.0)
    assert d["code avg"][0] == pytest.approx(0.025) and d["code avg"][1] > 0  # paired: no item noise left
    assert arms.arm_of("single-seed2@46.a0") == "single-seed2" and arms.arm_of("base") == "base"
    with pytest.raises(ValueError, match="no benchmark has both"):
        arms.paired_difference(scores, "pop", "nobody")
    (tmp_path / "old.json").write_text(json.dumps({"scores": {"base": {"mbpp_plus": {"pass@1": 0.5}}}}))
    assert arms.main([str(tmp_path / "old.json")]) == 2


def test_pooled_arms_average_seeds_and_runs_must_agree_on_shared_members(tmp_path, capsys):
    n = 100
    zero, ten, thirty = np.zeros(n), np.zeros(n), np.zeros(n)
    ten[:10] = 1
    thirty[:30] = 1
    # two runs' files: the base model appears in both, and a seed with four members counts once, like one with one
    run1 = _results(tmp_path / "r1.json", "humaneval_plus", {"base": zero, "pop-seed1@40.t0": ten,
                                                              "pop-seed1@40.s0": ten, "single-seed1@40.a0": zero})
    run2 = _results(tmp_path / "r2.json", "humaneval_plus", {"base": zero, "pop-seed2@40.t0": thirty})
    scores = arms.arm_scores(arms.load_outcomes([run1, run2]))
    pooled = arms.pool_arms(scores, "pop", ["pop-seed1", "pop-seed2"])
    assert arms.paired_difference(pooled, "pop", "base")["humaneval_plus"][0] == pytest.approx(0.20)  # (10 + 30) / 2
    assert "pop" not in scores["humaneval_plus"]  # the input is left as it was
    with pytest.raises(ValueError, match="no results for pop-seed9"):
        arms.pool_arms(scores, "pop", ["pop-seed1", "pop-seed9"])
    with pytest.raises(ValueError, match="exists already"):
        arms.pool_arms(scores, "base", ["pop-seed1"])
    assert arms.main([str(run1), str(run2), "--pool", "pop=pop-seed1,pop-seed2", "--pair", "pop", "base"]) == 0
    assert "| pop - base | +20.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        arms.main([str(run1), "--pool", "pop"])  # no '=': a usage error naming the flag
    assert "--pool 'pop'" in capsys.readouterr().err
    clash = _results(tmp_path / "r3.json", "humaneval_plus", {"base": ten})  # another "base" with other outcomes
    with pytest.raises(ValueError, match="base/humaneval_plus differs"):
        arms.load_outcomes([run1, clash])


def test_arm_band_means_seeds_and_plot_draws_one_figure(tmp_path, capsys):
    runs = [_write_run(tmp_path, 0.0, steps=6, name="2t2s-seed1", seed=1),
            _write_run(tmp_path, 0.0, steps=4, name="2t2s-seed2", seed=2)]
    loaded = [dyn.load_run(r) for r in runs]
    steps, mean, lo, hi = dyn.arm_band(loaded, "populora/coverage/cells_filled")
    assert steps.tolist() == [1, 2, 3, 4, 5, 6] and mean.tolist() == [1, 2, 3, 4, 5, 6]  # both seeds: min(s, 7)
    steps, mean, lo, hi = dyn.arm_band(loaded, "populora/validity/mean")
    assert mean[3] == pytest.approx((4 / 6 + 4 / 4) / 2) and (lo[3], hi[3]) == (pytest.approx(4 / 6), 1.0)
    assert mean[5] == pytest.approx(1.0) and lo[5] == hi[5]  # step 6: only the longer seed
    _, smoothed, _, _ = dyn.arm_band(loaded[:1], "populora/validity/mean", smooth=2)
    assert smoothed[1] == pytest.approx((1 / 6 + 2 / 6) / 2)  # a trailing window over the seed's own steps
    assert dyn.main([*map(str, runs), "--compare", "--plot", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "arms.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        dyn.main([str(runs[0]), "--plot", str(tmp_path / "fig")])  # --plot alone: a usage error
    assert "--plot needs --compare" in capsys.readouterr().err
