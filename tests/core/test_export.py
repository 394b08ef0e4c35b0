"""``populora-export``: a member becomes a PEFT folder that PeftModel.from_pretrained loads with the run's outputs."""

from __future__ import annotations

import json

import pytest
import torch

from populora_verl.export import export_member, main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A CPU-driver run dir whose step-1 checkpoint holds non-trivial adapters, and the driver that wrote it."""
    from populora_verl.local.__main__ import build_configs, parse_args
    from populora_verl.local.driver import LocalDriver

    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg, local = build_configs(parse_args(["--run-dir", str(run_dir), "-q", "local.tensorboard=false"]))
    d = LocalDriver(cfg, local, run_dir)
    g = torch.Generator().manual_seed(0)
    for m in d.population.members:  # founders start at B=0 (= the base model): give each its own weights
        slot = d.slot_of(m.id)
        d.engine.set_adapter(slot, {k: torch.randn(v.shape, generator=g) * 0.5
                                    for k, v in d.engine.get_adapter(slot).items()})
    d.save(1)
    yield run_dir, d
    d.close()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_exported_member_loads_with_peft_and_matches_the_run(run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, driver = run
    member = driver.population.students()[0].id
    assert main([str(run_dir), member, str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert f"--lora-modules {member}={tmp_path / 'out'}" in printed and printed.startswith(f"wrote {tmp_path / 'out'}")
    out = tmp_path / "out"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((run_dir / "base_model").resolve())
    info = json.loads((out / "populora_member.json").read_text())
    assert info["member"] == member and info["lineage"]["role"] == "student" and "mu" in info["rating"]

    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]).eval()
    ids = torch.tensor([driver.engine.tokenizer("def f(x):\n    return x", add_special_tokens=False)["input_ids"]])
    plain = _logits(base, ids)
    exported = PeftModel.from_pretrained(base, str(out)).eval()
    got = _logits(exported, ids)
    driver.engine.model.set_adapter(driver.slot_of(member))
    want = _logits(driver.engine.model, ids)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapter is really applied


def test_export_errors(run, tmp_path, capsys):
    run_dir, driver = run
    with pytest.raises(FileNotFoundError, match=r"member 'x9' is not a member of this run"):
        export_member(run_dir, "x9", tmp_path / "o")
    export_member(run_dir, "t0", tmp_path / "o")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_member(run_dir, "t0", tmp_path / "o")
    export_member(run_dir, "t0", tmp_path / "o", overwrite=True, base_model="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert json.loads((tmp_path / "o" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert main([str(tmp_path / "nothing"), "t0", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"populora-export: error: run_dir {tmp_path / 'nothing'}: no such directory"
    (tmp_path / "file").write_text("x")
    assert main([str(run_dir), "t0", str(tmp_path / "file" / "p")]) == 2  # checked before anything is copied
    assert capsys.readouterr().err.strip() == (f"populora-export: error: out's parent folder {tmp_path / 'file'}: "
                                               "is a file, not a folder")


def test_an_unknown_member_or_step_is_bad_input_that_lists_what_the_run_has(run, tmp_path, capsys):
    run_dir, driver = run
    alive = sorted(m.id for m in driver.population.members)
    assert main([str(run_dir), "x9", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (f"populora-export: error: member 'x9' is not a member of this run "
                                               f"(step_1); members with an adapter: {alive}")
    assert main([str(run_dir), "t0", str(tmp_path / "o"), "--step", "99"]) == 2
    assert capsys.readouterr().err.strip() == (f"populora-export: error: --step 99: no population checkpoint of that "
                                               f"step under {run_dir}; steps with one: [1]")
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "t0", str(tmp_path / "o")]) == 2
    assert "(not a PopuLoRA run, or none saved yet)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_verl_layout_is_found(run, tmp_path):
    """A verl run keeps the population under global_step_N/populora/checkpoints/step_N."""
    import shutil

    from populora_verl.export import find_member_population

    run_dir, _ = run
    verl = tmp_path / "verl"
    shutil.copytree(run_dir / "checkpoints", verl / "global_step_1" / "populora" / "checkpoints")
    (verl / "latest_checkpointed_iteration.txt").write_text("1")
    assert find_member_population(verl) == verl / "global_step_1" / "populora" / "checkpoints" / "step_1" / "population"
    assert find_member_population(verl, step=1).is_dir()


def test_serve_command_rounds_the_rank_up_to_a_vllm_value(tmp_path):
    from populora_verl.export import serve_command

    for r, want in ((4, 8), (8, 8), (12, 16), (64, 64), (300, 320)):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"r": r, "base_model_name_or_path": "/m"}))
        assert serve_command(tmp_path, "s1").endswith(f"--max-lora-rank {want}")

