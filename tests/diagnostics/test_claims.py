"""The claims table on synthetic run folders: per-seed values, exact permutation p and verdicts against hand-computed
ones, the note on seed counts that cannot reach significance, benchmark roles (teachers, students, weakest member),
and the realised-compute table's >10 % flag."""

from __future__ import annotations

import json

import pytest

from populora_verl.diagnostics import claims as cl
from populora_verl.diagnostics.dynamics import load_run, seed_permutation_p

STEPS = 10


def _write_run(root, name, *, slope=0.0, cells=5, oscillate=False, teacher_reward=-0.5, student_reward=0.5,
               compute=None, config=None):
    """A run folder: exact complexity slope, final CVT cells, a pair series that flips every step (oscillate) or
    rises steadily, constant role rewards; ``compute`` maps a step to extra compute keys."""
    run = root / name
    run.mkdir(parents=True)
    single = name.startswith("single")
    members = ["a0"] if single else ["t0", "s0"]
    pair = "populora/pair/a0/a0/solve_rate" if single else "populora/pair/t0/s0/solve_rate"
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, STEPS + 1):
            row = {
                "step": s,
                "populora/complexity/cyclomatic/mean": 3.0 + slope * s,
                "populora/complexity/loc/mean": 10.0,
                "populora/complexity/num_programs": 2.0,
                "populora/coverage/cells_filled": float(min(s, cells)),
                pair: (0.2 if s % 2 else 0.6) if oscillate else s / 20,
                "populora/role/teacher/reward_mean": teacher_reward,
                "populora/role/student/reward_mean": student_reward,
            }
            if single:
                row["populora/reward/a0/mean"] = (teacher_reward + student_reward) / 2
            else:
                row["populora/reward/t0/mean"] = teacher_reward
                row["populora/reward/s0/mean"] = student_reward
            for m in members:
                row[f"populora/rating/{m}/mu"] = 25.0
            row.update((compute or {}).get(s, {}))
            f.write(json.dumps(row) + "\n")
    if config is not None:
        (run / "config_as_run.yaml").write_text(config)
    return run


def _load(paths):
    runs = []
    for p in paths:
        r = load_run(p)
        r["path"] = str(p)
        runs.append(r)
    return runs


def _by(claims, start, role):
    (c,) = [c for c in claims if c["claim"].startswith(start) and c["role"] == role]
    return c


def test_smallest_p_is_the_permutation_tests_own_floor():
    assert cl.smallest_p(2, 2) == pytest.approx(1 / 3)
    assert cl.smallest_p(3, 3) == pytest.approx(0.1)  # 3 + 3 can never go below 0.1
    assert cl.smallest_p(4, 2) == pytest.approx(1 / 15)
    assert cl.smallest_p(4, 4) == pytest.approx(2 / 70)
    assert cl.smallest_p(1, 4) is None
    for na, nb in [(2, 2), (2, 3), (3, 3), (4, 2), (4, 4), (5, 3)]:
        apart = seed_permutation_p(list(range(na)), [100.0 + i for i in range(nb)])
        assert cl.smallest_p(na, nb) == pytest.approx(apart)


def test_verdict_rule():
    assert cl.verdict(0.3, 0.02, +1, 4, 4) == ("reproduced", [])
    assert cl.verdict(0.3, 0.17, +1, 4, 4) == ("cannot tell", [])
    assert cl.verdict(-0.3, 0.5, +1, 4, 4) == ("not reproduced", [])
    assert cl.verdict(0.0, 1.0, -1, 4, 4) == ("not reproduced", [])
    assert cl.verdict(-0.3, 0.02, +1, 4, 4) == ("not reproduced", ["significant the other way"])
    assert cl.verdict(-0.3, 0.02, 0, 4, 4) == ("reproduced", [])  # no stated direction: either way counts
    assert cl.verdict(-0.3, 0.3, 0, 4, 4) == ("cannot tell", [])
    v, notes = cl.verdict(0.3, 0.1, +1, 3, 3)
    assert v == "cannot tell"
    assert notes == ["cannot reach p < 0.05 with 3 + 3 seeds by construction (smallest p 0.100)"]
    v, notes = cl.verdict(None, None, +1, 1, 3)
    assert v == "cannot tell" and notes == ["fewer than 2 seeds with a value in an arm"]


def test_dynamics_claims_four_seeds_each(tmp_path):
    pop = [0.02, 0.03, 0.04, 0.05]
    single = [-0.05, -0.04, -0.03, -0.02]
    paths = []
    for i, (ps, ss) in enumerate(zip(pop, single), start=1):
        paths.append(_write_run(tmp_path, f"single-seed{i}", slope=ss, cells=4 + i, teacher_reward=-0.6 + 0.1 * i))
        paths.append(_write_run(tmp_path, f"2t2s-seed{i}", slope=ps, cells=i, oscillate=True,
                                teacher_reward=-1.0 + 0.1 * i))
    claims = [cl.judge(c) for c in cl.dynamics_claims(_load(paths), "single", ["2t2s"])]

    # fully apart, 4 + 4 seeds: only the observed split and its mirror are as extreme, p = 2 / C(8, 4)
    c = _by(claims, "complexity", "teachers")
    assert c["effect"] == pytest.approx(0.07)
    assert c["p"] == pytest.approx(2 / 70)
    assert (c["verdict"], c["notes"]) == ("reproduced", [])
    assert c["b"]["2t2s-seed1"] == pytest.approx(0.02)
    assert c["secondary"].startswith("over steps, slope difference: +0.0700")

    c = _by(claims, "coverage", "teachers")  # population 1-4 cells, single 5-8: the opposite of the paper
    assert c["effect"] == pytest.approx(-4.0)
    assert c["p"] == pytest.approx(2 / 70)
    assert (c["verdict"], c["notes"]) == ("not reproduced", ["significant the other way"])

    c = _by(claims, "oscillation", "pairs")  # a flip at every chance against a steady rise
    assert c["b"] == {f"2t2s-seed{i}": 1.0 for i in range(1, 5)}
    assert c["a"] == {f"single-seed{i}": 0.0 for i in range(1, 5)}
    assert c["p"] == pytest.approx(2 / 70) and c["verdict"] == "reproduced"

    c = _by(claims, "training reward", "teachers")  # population -0.9..-0.6, single -0.5..-0.2: lower, as claimed
    assert c["effect"] == pytest.approx(-0.4)
    assert c["p"] == pytest.approx(2 / 70) and c["verdict"] == "reproduced"
    assert c["secondary"] == "over steps of the window: -0.400 [95 % -0.400, -0.400]"

    c = _by(claims, "training reward", "students")  # the same in both arms: no effect
    assert c["effect"] == pytest.approx(0.0) and c["p"] == 1.0
    assert c["verdict"] == "not reproduced"

    c = _by(claims, "training reward", "all members")  # mean of t0 and s0 against a0's own
    assert c["effect"] == pytest.approx(-0.2)
    assert c["p"] == pytest.approx(2 / 70) and c["verdict"] == "reproduced"


def test_two_seeds_each_hand_computed_p_and_the_unreachable_note(tmp_path):
    # teacher reward: population 1, 3 against single 2, 4. Of the 6 splits of {1, 2, 3, 4} into pairs, |difference
    # of means| is 2, 1, 0, 0, 1, 2: four reach the observed 1, so p = 4 / 6.
    paths = [
        _write_run(tmp_path, "2t2s-seed1", teacher_reward=1.0),
        _write_run(tmp_path, "2t2s-seed2", teacher_reward=3.0),
        _write_run(tmp_path, "single-seed1", teacher_reward=2.0),
        _write_run(tmp_path, "single-seed2", teacher_reward=4.0),
    ]
    claims = [cl.judge(c) for c in cl.dynamics_claims(_load(paths), "single", ["2t2s"])]
    c = _by(claims, "training reward", "teachers")
    assert c["effect"] == pytest.approx(-1.0)
    assert c["p"] == pytest.approx(4 / 6)
    assert c["verdict"] == "cannot tell"
    assert c["notes"] == ["cannot reach p < 0.05 with 2 + 2 seeds by construction (smallest p 0.333)"]
    text = cl.markdown(claims, [])
    assert "cannot reach p < 0.05 with 2 + 2 seeds by construction (smallest p 0.333)" in text


def _outcomes(k, n=10):
    return [1] * k + [0] * (n - k)


def _write_eval(root, run, members, step=40, extra=None):
    """``<root>/eval/<run>/results.json``: ``members`` maps an id to correct answers of 10 on both benchmarks."""
    scores = {}
    for mid, k in members.items():
        scores[f"{run}@{step}.{mid}"] = {
            b: {"n": 10, "correct": k, "pass@1": k / 10, "outcomes": _outcomes(k)} for b in ("humaneval_plus", "mbpp_plus")
        }
    scores.update(extra or {})
    d = root / "eval" / run
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"scores": scores}))
    return d / "results.json"


def test_benchmark_claims_per_role_hand_computed(tmp_path):
    base = {"base": {b: {"outcomes": _outcomes(7)} for b in ("humaneval_plus", "mbpp_plus")}}
    stale = {"2t2s-seed1@20.t0": {b: {"outcomes": _outcomes(1)} for b in ("humaneval_plus", "mbpp_plus")}}
    files = [
        _write_eval(tmp_path, "2t2s-seed1", {"t0": 8, "t1": 8, "s0": 6, "s1": 7}, extra={**base, **stale}),
        _write_eval(tmp_path, "2t2s-seed2", {"t0": 9, "t1": 7, "s0": 7, "s1": 5}),
        _write_eval(tmp_path, "single-seed1", {"a0": 5}, extra=base),
        _write_eval(tmp_path, "single-seed2", {"a0": 5}),
        _write_eval(tmp_path, "single-seed3", {"a0": 6}),
    ]
    outcomes = cl.member_outcomes(files)
    assert set(outcomes) == {"2t2s-seed1", "2t2s-seed2", "single-seed1", "single-seed2", "single-seed3"}
    assert set(outcomes["2t2s-seed1"]) == {"t0", "t1", "s0", "s1"}  # step 40 kept, step 20 and the base left out
    claims = [cl.judge(c) for c in cl.benchmark_claims(outcomes, "single", ["2t2s"])]
    assert {c["claim"].split(" pass@1")[0] for c in claims} == {"HumanEval+", "MBPP+", "code avg"}
    note = "cannot reach p < 0.05 with 2 + 3 seeds by construction (smallest p 0.100)"

    # all members: 0.725, 0.700 against 0.5, 0.5, 0.6; only the observed split of the 10 is as extreme: p = 1 / 10
    c = _by(claims, "HumanEval+", "all members")
    assert c["b"] == {"2t2s-seed1": pytest.approx(0.725), "2t2s-seed2": pytest.approx(0.7)}
    assert c["effect"] == pytest.approx(0.7125 - 1.6 / 3)
    assert c["p"] == pytest.approx(0.1)
    assert (c["verdict"], c["notes"]) == ("cannot tell", [note])
    assert c["secondary"].startswith("over items, paired bootstrap: +17.9 [95 % ")

    c = _by(claims, "HumanEval+", "teachers")  # 0.8, 0.8: again only the observed split
    assert c["effect"] == pytest.approx(0.8 - 1.6 / 3) and c["p"] == pytest.approx(0.1)

    # students 0.65, 0.6 against 0.5, 0.5, 0.6: the splits {0.65, either 0.6} and {0.5, 0.5} are as far apart, 3 of 10
    c = _by(claims, "HumanEval+", "students")
    assert c["effect"] == pytest.approx(0.625 - 1.6 / 3) and c["p"] == pytest.approx(0.3)

    # weakest members 0.6 (s0) and 0.5 (s1): every split of {0.6, 0.5, 0.5, 0.5, 0.6} differs at least as much
    c = _by(claims, "HumanEval+", "weakest member")
    assert c["b"] == {"2t2s-seed1": pytest.approx(0.6), "2t2s-seed2": pytest.approx(0.5)}
    assert c["p"] == pytest.approx(1.0) and c["verdict"] == "cannot tell"
    assert "weakest chosen on all items" in c["secondary"]

    # teachers 0.8, 0.8 against students 0.65, 0.6 within the population: 2 + 2, p = 2 / 6, no stated direction
    c = _by(claims, "HumanEval+", "teachers vs students")
    assert c["direction"] == 0
    assert c["effect"] == pytest.approx(0.175) and c["p"] == pytest.approx(1 / 3)
    assert c["verdict"] == "cannot tell"
    assert c["notes"] == ["cannot reach p < 0.05 with 2 + 2 seeds by construction (smallest p 0.333)"]

    c = _by(claims, "code avg", "all members")  # both benchmarks the same here, so the code average is too
    assert c["effect"] == pytest.approx(0.7125 - 1.6 / 3)


def test_compute_table_flags_steps_more_than_ten_percent_off_plan(tmp_path):
    logged = {
        s: {
            # 22 of 20 is 10 % on the dot: not flagged
            "populora/compute/t0/planned": 20.0, "populora/compute/t0/realised": 22.0,
            "populora/compute/s0/planned": 40.0, "populora/compute/s0/realised": 45.0 if s == 3 else 40.0,
            "populora/compute/s1/planned": 40.0, "populora/compute/s1/realised": 0.0 if s in (7, 8) else 40.0,
        }
        for s in range(1, STEPS + 1)
    }
    pop = _write_run(tmp_path, "2t2s-seed1", compute=logged)
    # no per-adapter plan logged: the single agent's from its config (AZR defaults: 12 + 96 per step)
    single = _write_run(
        tmp_path, "single-seed1", config="populora:\n  population:\n    mode: single_agent\n",
        compute={s: {"populora/compute/a0/trajectories": 108.0} for s in range(1, STEPS + 1)},
    )
    # nothing but the member mean: that is the plan, marked as such
    mean_only = _write_run(
        tmp_path, "single-seed2",
        compute={s: {"populora/compute/a0/trajectories": 30.0 if s != 5 else 20.0,
                     "populora/compute/planned_trajectories": 30.0} for s in range(1, STEPS + 1)},
    )
    rows = {(r["run"], r["adapter"]): r for r in cl.compute_table(_load([pop, single, mean_only]))}
    assert rows[("2t2s-seed1", "t0")]["off_plan"] == []
    assert rows[("2t2s-seed1", "s0")]["off_plan"] == [(3, 45.0, 40.0)]
    assert [s for s, _, _ in rows[("2t2s-seed1", "s1")]["off_plan"]] == [7, 8]
    assert rows[("2t2s-seed1", "s1")]["plan_source"] == "logged"
    assert rows[("single-seed1", "a0")]["plan_source"] == "config"
    assert rows[("single-seed1", "a0")]["off_plan"] == []
    assert rows[("single-seed2", "a0")]["plan_source"] == "member mean"
    assert rows[("single-seed2", "a0")]["off_plan"] == [(5, 20.0, 30.0)]
    text = cl.markdown([], list(rows.values()))
    assert "- **2t2s-seed1 s1** (student) off its plan on 2 of 10 steps: 0 of 40 on step 7–8" in text
    assert "- **2t2s-seed1 s0** (student) off its plan on 1 of 10 steps: 45 of 40 on step 3" in text
    assert "**2t2s-seed1 t0**" not in text
    assert "No adapter was more than 10 % off" in cl.markdown([], [rows[("single-seed1", "a0")]])


def test_cli_on_a_results_folder(tmp_path, capsys):
    folder = tmp_path / "results"
    for i in (1, 2, 3):
        _write_run(folder, f"single-seed{i}", slope=-0.01 * i,
                   compute={s: {"populora/compute/a0/trajectories": 30.0} for s in range(1, STEPS + 1)})
        _write_run(folder, f"2t2s-seed{i}", slope=0.01 * i, oscillate=True,
                   compute={s: {"populora/compute/t0/trajectories": 12.0, "populora/compute/s0/trajectories": 48.0,
                                "populora/compute/planned_trajectories": 30.0} for s in range(1, STEPS + 1)})
        _write_eval(folder, f"single-seed{i}", {"a0": 5})
        _write_eval(folder, f"2t2s-seed{i}", {"t0": 7, "s0": 6})
    out = tmp_path / "CLAIMS.md"
    assert cl.main(["--runs", str(folder), "--out", str(out)]) == 0
    text = out.read_text()
    assert capsys.readouterr().out.strip() == text.strip()
    assert "Single agent: single; population: 2t2s." in text
    assert "Evaluated seeds: 2t2s (2t2s-seed1, 2t2s-seed2, 2t2s-seed3)" in text
    # 3 + 3 seeds fully apart: p = 2 / C(6, 3) = 0.1, never below it
    row = [line for line in text.splitlines() if line.startswith("| complexity")][0]
    assert "| 3 + 3 | 0.100 | **cannot tell** | cannot reach p < 0.05 with 3 + 3 seeds by construction" in row
    assert "| HumanEval+ pass@1: the population beats the single agent | all members |" in text
    # the member-mean plan of 30 puts the teacher (12) and student (48) off it on every step
    assert "- **2t2s-seed1 t0** (teacher) off its plan on 10 of 10 steps: 12 of 30 on step 1–10" in text


def test_cli_errors_in_one_line(tmp_path, capsys):
    _write_run(tmp_path, "2t2s-seed1")
    _write_run(tmp_path, "4t4s-seed1")
    assert cl.main(["--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("claims: error: cannot tell the single-agent arm") and err.count("\n") == 1
    assert cl.main(["--runs", str(tmp_path / "nothing")]) == 2
    assert "not a folder" in capsys.readouterr().err
