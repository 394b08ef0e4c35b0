"""End to end on the embedded tiny random model: 2T+2S with an evolution event, the single-agent baseline, the
per-adapter update isolation, and the CLI's start-up validation."""

from __future__ import annotations

import json

import pytest
import torch

from populora_verl.local.__main__ import build_configs, main, parse_args
from populora_verl.local.driver import LocalDriver
from populora_verl.step import Sample


def _driver(run_dir, *extra, resume=False):
    args = parse_args(["--run-dir", str(run_dir), "-q", "populora.rollout.max_new_tokens=16", "local.tensorboard=false",
                       *extra] + (["--resume"] if resume else []))
    cfg, local = build_configs(args)
    return LocalDriver(cfg, local, run_dir, resume=resume)


def test_population_run_end_to_end(tmp_path):
    d = _driver(tmp_path, "--steps", "3", "local.tensorboard=true")
    try:
        founders = d.adapters()
        history = d.run()
    finally:
        d.close()
    assert [int(h.get("populora/evolution/events", -1)) for h in history] == [0, 2, 0]  # interval 2: one event
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("populora/rating/t0/mu", "populora/rating/s1/sigma", "populora/validity/mean",
                "populora/coverage/fraction", "populora/reward/t0/mean", "populora/evolution/events"):
        assert key in rows[0], key
    # A pair solve rate appears only when a teacher posed a valid task; the random model rarely does.
    assert (tmp_path / "plots" / "ratings.png").is_file()
    assert any((tmp_path / "tb").iterdir())
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    pop = d.population
    children = [m for m in pop.lineage if m.parents]
    assert {m.role for m in children} == {"teacher", "student"} and all(m.birth_step == 2 for m in children)
    for c in children:  # the child sits in its victim's slot and differs from the victim it replaced
        victim = next(m for m in pop.lineage if m.death_step == 2 and m.slot == c.slot)
        assert victim.role == c.role
    evo = [json.loads(x) for x in (tmp_path / "evolution.jsonl").read_text().splitlines()]
    assert len(evo) == 1 and len(evo[0]["replacements"]) == 2
    ck = tmp_path / "checkpoints" / "step_3"
    # local.keep_checkpoints (default 2): a checkpoint every step, the two newest kept
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2", "step_3"]
    assert not (tmp_path / "run.lock").exists()  # close() freed the run directory
    for m in pop.members:
        assert (ck / "population" / "adapters" / m.id / "adapter_model.safetensors").is_file()
        assert (ck / "optimizer" / f"{m.id}.pt").is_file()
    for f in ("state.json", "buffers.json", "coverage.npz", "population/population.json"):
        assert (ck / f).is_file(), f
    # The embedded tiny base model is saved with the run, so a saved member loads on its own (populora-eval).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    member = pop.members[0].id
    adapter_dir = ck / "population" / "adapters" / member
    base_dir = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_dir == str((tmp_path / "base_model").resolve())
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    from peft import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(peft_model)
    saved = d.adapters()[member]
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert set(founders) == {"t0", "t1", "s0", "s1"}


def test_single_agent_baseline_runs(tmp_path):
    d = _driver(tmp_path, "--single-agent", "--steps", "2")
    try:
        history = d.run()
    finally:
        d.close()
    assert d.population.ids() == ["a0"] and len(history) == 2
    assert "populora/reward/a0/mean" in history[-1] and "populora/train/a0/loss" in history[-1]
    assert not (tmp_path / "evolution.jsonl").exists()


def test_update_moves_only_the_active_adapter(tmp_path):
    d = _driver(tmp_path, "local.lr=0.01")
    try:
        eng = d.engine
        before = {s: eng.get_adapter(s) for s in eng.slots}
        tok = eng.tokenizer
        prompt = tok("def f(a):", add_special_tokens=False)["input_ids"]
        samples = [Sample("s0", "student", "code_o", "p", "r", reward=r, advantage=a, length=3,
                          extra=(prompt, tok(" return a", add_special_tokens=False)["input_ids"]))
                   for r, a in ((1.0, 1.0), (-1.0, -1.0))]
        stats = eng.update("slot2", samples)
        assert stats["tokens"] > 0 and stats["grad_norm"] > 0
        after = {s: eng.get_adapter(s) for s in eng.slots}
        for s in eng.slots:
            same = all(torch.equal(before[s][k], after[s][k]) for k in before[s])
            assert same == (s != "slot2"), s
        # Each slot has its own optimizer: only slot2's has state.
        assert eng.optimizer_state("slot2")["state"] and not eng.optimizer_state("slot0")["state"]
    finally:
        d.close()


@pytest.mark.parametrize("override, key", [
    ("populora.pbt.cull_fraction=2", "populora.pbt.cull_fraction"),
    ("populora.pbt.bogus=1", "populora.pbt.bogus"),
    ("local.lr=-1", "local.lr"),
    ("local.nope=1", "local.nope"),
    ("populora.population.num_students=3", "populora.population.num_students"),  # not compute-matched per adapter
])
def test_cli_rejects_bad_config_with_one_line(tmp_path, capsys, override, key):
    assert main(["--run-dir", str(tmp_path), override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_quiet_drops_the_bar_but_keeps_the_step_lines(tmp_path, capsys):
    assert main(["--run-dir", str(tmp_path / "r"), "-q", "--steps", "1", "populora.rollout.max_new_tokens=8",
                 "local.tensorboard=false", "populora.diagnostics.plots=false"]) == 0
    out, err = capsys.readouterr()
    assert "step 1/1 | teachers: " in out
    assert "step/s" not in out + err  # no progress bar
    # no start-up warning about the driver's own default population (2T+2S: one lineage per role is the demo)
    assert "sub-population has 2 members" not in out + err
