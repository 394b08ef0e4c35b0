"""Population: members, TrueSkill ratings, outcome rules, PFSP matchmaking, exact save/load."""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from populora_verl.config import load_config
from populora_verl.population import (
    DRAW,
    STUDENT_WINS,
    TEACHER_WINS,
    Matchmaker,
    Population,
    Ratings,
    match_outcomes,
    pfsp_weight,
)
from populora_verl.population import state as state_mod

LORA_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _cfg(**sections):
    return load_config(sections)


def _adapter(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(2):
        for mod, (d_in, d_out) in {"q_proj": (16, 16), "v_proj": (16, 8)}.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            sd[f"{pre}.lora_A.weight"] = torch.randn(4, d_in, generator=g).to(dtype)
            sd[f"{pre}.lora_B.weight"] = torch.randn(d_out, 4, generator=g).to(dtype)
    return sd


# --- members ----------------------------------------------------------------------------------------------------


def test_create_population_ids_roles_slots():
    pop = Population.create(_cfg(population={"num_teachers": 3, "num_students": 2}))
    assert pop.ids() == ["t0", "t1", "t2", "s0", "s1"]
    assert [m.slot for m in pop.members] == [0, 1, 2, 3, 4]
    assert [m.id for m in pop.teachers()] == ["t0", "t1", "t2"]
    assert [m.id for m in pop.students()] == ["s0", "s1"]
    assert pop.member("s1").role == "student" and pop.member("s1").parents == ()
    assert set(pop.ratings.ids()) == set(pop.ids())
    assert all(pop.ratings.mu(i) == 25.0 and pop.ratings.sigma(i) == pytest.approx(25 / 3) for i in pop.ids())
    assert pop.next_id("teacher") == "t3" and pop.next_id("student", 2) == "s4"


def test_single_agent_plays_both_roles_without_self_rating():
    cfg = _cfg(population={"mode": "single_agent"})
    pop = Population.create(cfg)
    assert pop.ids() == ["a0"] and pop.member("a0").role == "both"
    assert [m.id for m in pop.teachers()] == [m.id for m in pop.students()] == ["a0"]
    assert Matchmaker(cfg.matchmaking, seed=0).pairs(pop, 0) == [("a0", "a0")]
    assert pop.ratings.rate_match("a0", "a0", [1.0, 1.0]) == []
    assert pop.ratings.mu("a0") == 25.0 and pop.ratings.sigma("a0") == pytest.approx(25 / 3)


def test_replace_records_death_and_lineage():
    pop = Population.create(_cfg(population={"num_teachers": 2, "num_students": 2}))
    child = pop.replace("t1", "t2", ["t0"], "svd_mutation", step=10)
    assert child.slot == 1 and child.generation == 1 and child.parents == ("t0",)
    assert pop.member("t1").death_step == 10 and pop.member("t1").final_mu == 25.0
    assert "t1" not in pop.ratings and pop.ids() == ["t0", "t2", "s0", "s1"]
    assert [m.id for m in pop.lineage] == ["t0", "t1", "s0", "s1", "t2"]
    with pytest.raises(ValueError, match="already dead"):
        pop.replace("t1", "t3", ["t0"], "svd_mutation", step=11)


# --- ratings and outcomes -----------------------------------------------------------------------------------


def test_ratings_move_the_right_way():
    r = Ratings()
    for i in ("t", "s"):
        r.add(i)
    r.rate_game("t", "s", STUDENT_WINS)
    assert r.mu("s") > 25 > r.mu("t")
    assert r.sigma("s") < 25 / 3 and r.sigma("t") < 25 / 3
    assert r.win_probability("s", "t") > 0.5
    mu_s, mu_t = r.mu("s"), r.mu("t")
    r.rate_game("t", "s", TEACHER_WINS)
    assert r.mu("s") < mu_s and r.mu("t") > mu_t
    # A draw pulls two unequal players together.
    r2 = Ratings()
    r2.add("t", mu=30.0, sigma=3.0)
    r2.add("s", mu=20.0, sigma=3.0)
    r2.rate_game("t", "s", DRAW)
    assert r2.mu("t") < 30 and r2.mu("s") > 20


def test_win_probability_formula():
    r = Ratings(beta=4.0)
    r.add("t", mu=27.0, sigma=2.0)
    r.add("s", mu=24.0, sigma=3.0)
    expected = 0.5 * math.erfc(-((24 - 27) / math.sqrt(4 + 9 + 2 * 16)) / math.sqrt(2))
    # env.cdf is trueskill's own erfc approximation (~1e-7 accurate), identical on every machine.
    assert r.win_probability("s", "t") == pytest.approx(expected, abs=1e-6)
    assert r.win_probability("s", "t") + r.win_probability("t", "s") == pytest.approx(1.0)
    assert r.conservative("s") == pytest.approx(24 - 9)


def test_outcome_rules():
    assert match_outcomes([0.75, 0.25], 0.4) == [STUDENT_WINS]
    assert match_outcomes([0.75, 0.25], 0.6) == [TEACHER_WINS]
    assert match_outcomes([0.5], 0.5) == [DRAW]
    assert match_outcomes([0.75, 0.25], 0.6, "vs_half") == [DRAW]
    assert match_outcomes([0.75], 0.9, "vs_half") == [STUDENT_WINS]
    assert match_outcomes([1.0, 0.0, 0.5, 0.125], 0.9, "per_problem") == [STUDENT_WINS, TEACHER_WINS, DRAW,
                                                                         TEACHER_WINS]
    for rule in ("vs_expected", "vs_half", "per_problem"):  # no valid problem: the teacher lost the round
        assert match_outcomes([], 0.3, rule) == [STUDENT_WINS]
    with pytest.raises(ValueError, match="solve rates"):
        match_outcomes([1.5], 0.5)
    with pytest.raises(ValueError, match="rule"):
        match_outcomes([0.5], 0.5, "bogus")


def test_rate_match_uses_expected_solve_rate():
    r = Ratings()
    r.add("t", mu=35.0)
    r.add("s", mu=20.0)
    p = r.win_probability("s", "t")
    assert p < 0.2
    # 0.3 solve rate beats the low expectation: a student win under vs_expected, a teacher win under vs_half.
    assert r.rate_match("t", "s", [0.3]) == [STUDENT_WINS] and r.mu("s") > 20
    r2 = Ratings()
    r2.add("t", mu=35.0)
    r2.add("s", mu=20.0)
    assert r2.rate_match("t", "s", [0.3], "vs_half") == [TEACHER_WINS] and r2.mu("s") < 20
    r3 = Ratings()
    r3.add("t")
    r3.add("s")
    assert r3.rate_match("t", "s", [1.0, 1.0, 0.0], "per_problem") == [STUDENT_WINS, STUDENT_WINS, TEACHER_WINS]


# --- matchmaking --------------------------------------------------------------------------------------------


def test_pfsp_weights():
    assert pfsp_weight(0.5) == 0.25 and pfsp_weight(0.9) == pytest.approx(0.09)
    assert pfsp_weight(0.2, "hard") == pytest.approx(0.8) and pfsp_weight(0.2, "uniform") == 1.0


def _two_by_two(weight="p_one_minus_p", method="pfsp_trueskill"):
    cfg = _cfg(population={"num_teachers": 2, "num_students": 2},
               matchmaking={"weight": weight, "method": method})
    pop = Population.create(cfg)
    # t0 ~ s0 (balanced) and t1 ~ s1 (balanced); the crossed pairs are lopsided.
    pop.ratings.load_ratings({"t0": [20.0, 2.0], "s0": [20.0, 2.0], "t1": [35.0, 2.0], "s1": [35.0, 2.0]}.items())
    return cfg, pop


def test_pfsp_favours_balanced_pairs():
    cfg, pop = _two_by_two()
    mm = Matchmaker(cfg.matchmaking, seed=0)
    counts = Counter(pair for step in range(400) for pair in mm.pairs(pop, step))
    balanced = counts[("t0", "s0")] / 400
    assert balanced > 0.8, counts  # w(balanced) = 0.25 vs w(crossed) ~ 0.04: ~86% expected
    assert counts[("t1", "s1")] == counts[("t0", "s0")]  # each step is a full matching
    cfg_u, pop_u = _two_by_two(method="uniform")
    mm_u = Matchmaker(cfg_u.matchmaking, seed=0)
    counts_u = Counter(pair for step in range(400) for pair in mm_u.pairs(pop_u, step))
    assert 0.4 < counts_u[("t0", "s0")] / 400 < 0.6, counts_u


def test_pfsp_pool_draws_every_student_before_refilling():
    cfg = _cfg(population={"num_teachers": 2, "num_students": 6})
    pop = Population.create(cfg)
    mm = Matchmaker(cfg.matchmaking, seed=3)
    drawn = [s for step in range(3) for _, s in mm.pairs(pop, step)]
    assert sorted(drawn) == [f"s{i}" for i in range(6)]  # three steps of two draws cover the pool exactly


def test_matchmaking_deterministic_and_state_roundtrip():
    cfg = _cfg(population={"num_teachers": 3, "num_students": 5})
    pop = Population.create(cfg)
    a, b = Matchmaker(cfg.matchmaking, seed=7), Matchmaker(cfg.matchmaking, seed=7)
    seq_a = [a.pairs(pop, s) for s in range(6)]
    assert seq_a == [b.pairs(pop, s) for s in range(6)]
    c = Matchmaker(cfg.matchmaking, seed=8)
    assert seq_a != [c.pairs(pop, s) for s in range(6)]
    state = a.state_dict()
    cont = [a.pairs(pop, s) for s in range(6, 12)]
    d = Matchmaker(cfg.matchmaking, seed=999)
    d.load_state_dict(state)
    assert [d.pairs(pop, s) for s in range(6, 12)] == cont


def test_students_per_problem_and_round_robin():
    cfg = _cfg(population={"num_teachers": 2, "num_students": 3}, matchmaking={"students_per_problem": 2})
    pop = Population.create(cfg)
    mm = Matchmaker(cfg.matchmaking, seed=0)
    for step in range(5):
        pairs = mm.pairs(pop, step)
        assert [t for t, _ in pairs] == ["t0", "t0", "t1", "t1"]
        assert pairs[0][1] != pairs[1][1] and pairs[2][1] != pairs[3][1]
    cfg = _cfg(population={"num_teachers": 2, "num_students": 3}, matchmaking={"method": "round_robin"})
    mm = Matchmaker(cfg.matchmaking)
    assert mm.pairs(pop, 0) == [("t0", "s0"), ("t1", "s1")]
    assert mm.pairs(pop, 1) == [("t0", "s1"), ("t1", "s2")]


# --- save / load --------------------------------------------------------------------------------------------


def _trained_population():
    cfg = _cfg(population={"num_teachers": 2, "num_students": 3})
    pop = Population.create(cfg)
    mm = Matchmaker(cfg.matchmaking, seed=11)
    for step in range(4):
        for i, (t, s) in enumerate(mm.pairs(pop, step)):
            pop.ratings.rate_match(t, s, [((step + i) % 3) / 3, 0.5])
        pop.step = step + 1
    pop.replace("s2", "s3", ["s0", "s1"], "dare_crossover", step=4)
    adapters = {mid: _adapter(n, torch.bfloat16 if mid.startswith("s") else torch.float32)
                for n, mid in enumerate(pop.ids())}
    return cfg, pop, mm, adapters


def test_save_load_exact_round_trip(tmp_path: Path):
    cfg, pop, mm, adapters = _trained_population()
    out = pop.save(tmp_path / "pop", adapters, LORA_CONFIG, states={"matchmaker": mm})
    assert (out / "population.json").is_file()
    assert (out / "adapters" / "s3" / "adapter_model.safetensors").is_file()
    assert (out / "adapters" / "s3" / "adapter_config.json").is_file()
    assert not (out / "adapters" / "s2").exists()  # dead members have no adapter

    pop2, adapters2 = Population.load(out)
    assert pop2.ids() == pop.ids() and pop2.step == pop.step == 4
    for mid in pop.ids():  # ratings equal to the bit
        assert (pop2.ratings.mu(mid), pop2.ratings.sigma(mid)) == (pop.ratings.mu(mid), pop.ratings.sigma(mid))
    assert [m.to_dict() for m in pop2.lineage] == [m.to_dict() for m in pop.lineage]
    assert pop2.member("s3").parents == ("s0", "s1") and pop2.member("s2").death_step == 4
    assert pop2.ratings.env_params == pop.ratings.env_params
    for mid, sd in adapters.items():
        assert list(adapters2[mid]) == list(sd)
        for k, v in sd.items():
            assert adapters2[mid][k].dtype == v.dtype and torch.equal(adapters2[mid][k], v)

    mm2 = Matchmaker(cfg.matchmaking, seed=0)
    mm2.load_state_dict(pop2.states["matchmaker"])
    assert [mm2.pairs(pop2, s) for s in range(5, 12)] == [mm.pairs(pop, s) for s in range(5, 12)]
    assert pop2.lora_config["r"] == 4

    # A save of the loaded population is the same file (the round trip is a fixed point).
    pop2.save(tmp_path / "pop2", adapters2, pop2.lora_config, states={"matchmaker": pop2.states["matchmaker"]})
    assert (tmp_path / "pop2" / "population.json").read_text() == (out / "population.json").read_text()


def test_save_is_atomic(tmp_path: Path, monkeypatch):
    _, pop, _, adapters = _trained_population()
    target = tmp_path / "pop"
    pop.save(target, adapters, LORA_CONFIG)
    before = (target / "population.json").read_text()
    pop.ratings.rate_game("t0", "s0", STUDENT_WINS)

    calls = {"n": 0}
    real = state_mod.write_adapter

    def failing(folder, sd, cfg):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real(folder, sd, cfg)

    monkeypatch.setattr(state_mod, "write_adapter", failing)
    with pytest.raises(OSError, match="disk full"):
        pop.save(target, adapters, LORA_CONFIG)
    assert (target / "population.json").read_text() == before  # the previous complete save survives
    assert sorted(os.listdir(tmp_path)) == ["pop"]  # no temp dir left behind
    monkeypatch.setattr(state_mod, "write_adapter", real)
    pop.save(target, adapters, LORA_CONFIG)  # replacing an existing save works
    assert (target / "population.json").read_text() != before
    assert sorted(os.listdir(tmp_path)) == ["pop"]


def test_load_rejects_incomplete_or_inconsistent(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not a complete population save"):
        Population.load(tmp_path)
    _, pop, _, adapters = _trained_population()
    with pytest.raises(ValueError, match="adapters missing"):
        pop.save(tmp_path / "x", {"t0": adapters["t0"]}, LORA_CONFIG)
    with pytest.raises(ValueError, match="lora_config"):
        pop.save(tmp_path / "x", adapters)
    pop.save(tmp_path / "ok")  # without adapters
    pop3, none = Population.load(tmp_path / "ok")
    assert none is None and pop3.ids() == pop.ids()


def test_saved_adapter_loads_with_peft(tmp_path: Path):
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    base_cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    base = Qwen2ForCausalLM(base_cfg).eval()
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lcfg, adapter_name="t0").eval()
    sd = get_peft_model_state_dict(model, adapter_name="t0")
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits

    cfg = _cfg(population={"mode": "single_agent"})
    pop = Population.create(cfg)
    pop.save(tmp_path / "pop", {"a0": sd}, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    fresh = Qwen2ForCausalLM(base_cfg)
    fresh.load_state_dict(base.state_dict(), strict=False)  # base weights only: peft wrapped `base` in place
    base_sd = {k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
               for k, v in model.state_dict().items() if "lora_" not in k}
    fresh.load_state_dict(base_sd)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "pop" / "adapters" / "a0")).eval()
    with torch.no_grad():
        out = loaded(input_ids=ids).logits
    assert torch.equal(out, ref)
