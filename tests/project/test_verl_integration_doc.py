"""docs/verl-integration.md lists exactly the runtime patches and private verl names of populora_verl/verl_private.py
(the list the drift test pins and proves complete), each with the patch that removes it: its two tables are the ones
``python -m populora_verl.verl_private`` renders from the list."""

from __future__ import annotations

import re

import pytest

from populora_verl import verl_private

from _shared import REPO

DOC = REPO / "docs" / "verl-integration.md"


def _table(tag: str) -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {tag}: generated from populora_verl/verl_private\.py -->\n(.*?)\n<!-- /{tag} -->", text, re.S)
    assert m, f"docs/verl-integration.md has no {tag} table"
    rows = [line for line in m.group(1).splitlines() if line.startswith("|")][2:]  # after the header and rule
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _removed_by(cell: str) -> str:
    return "" if cell == "none yet" else cell.strip("`")


def test_the_tables_are_rendered_from_the_list():
    text = DOC.read_text(encoding="utf-8")
    assert verl_private.DOC == DOC
    assert verl_private.render_doc(text) == text, (
        f"docs/verl-integration.md's tables are stale: run {verl_private.REGENERATE}"
    )


def test_rendering_keeps_the_prose_and_needs_both_tables():
    text = verl_private.render_doc(DOC.read_text(encoding="utf-8"))
    stale = text.replace("| on | `0010-chunked-logprob-fallback.patch` |", "| opt-in | none yet |")
    assert stale != text and verl_private.render_doc(stale) == text
    with pytest.raises(ValueError, match="private-names"):
        verl_private.render_doc(text.replace("<!-- /private-names -->", ""))


def test_the_command_rewrites_a_stale_copy(tmp_path, capsys):
    current = verl_private.render_doc(DOC.read_text(encoding="utf-8"))
    copy = tmp_path / "verl-integration.md"
    copy.write_text(current.replace("| `workers.logprobs` |", "| `workers.stale` |"), encoding="utf-8")
    assert verl_private.main(["--check", str(copy)]) == 1
    assert verl_private.REGENERATE in capsys.readouterr().out
    assert verl_private.main([str(copy)]) == 0
    assert copy.read_text(encoding="utf-8") == current
    assert verl_private.main(["--check", str(copy)]) == 0


def test_runtime_patch_table_matches_the_list():
    doc = [(row[0].strip("`"), row[1], row[3], _removed_by(row[4])) for row in _table("runtime-patches")]
    listed = [(rp.module.removeprefix("populora_verl."), rp.target, "on" if rp.default else "opt-in", rp.removed_by)
              for rp in verl_private.RUNTIME_PATCHES]
    assert doc == listed


def test_private_name_table_matches_the_list():
    doc = [(row[0].strip("`"), row[1].strip("`"), _removed_by(row[4])) for row in _table("private-names")]
    listed = [(e.name, e.owner, e.removed_by) for e in verl_private.PRIVATE]
    assert doc == listed


def test_no_claim_of_no_monkeypatching():
    text = DOC.read_text(encoding="utf-8").lower()
    assert "without runtime monkeypatching" not in text and "without monkeypatching" not in text


def test_every_runtime_patch_module_applies_one():
    # The modules named as patching really change something at run time (a rebinding, a wrapper or an environment
    # variable), one mark per entry of the module, in the list's order: a cheap guard against a list entry that
    # outlived its code.
    marks = {
        "populora_verl.workers.logprobs": ("mod.logprobs_from_logits = ",),
        "populora_verl.rollout.routing": ("self.engine = LoraRoutingEngine(",),
        "populora_verl.rollout.agent_loop": ("self.server_manager = LoraInjectingClient(",),
        "populora_verl.rollout.weight_sync": ("os.environ[JOB_ID_ENV] = ",),
        "populora_verl.rollout.server_adapter": ("self.zmq_handle = rewrite_zmq_handle(",),
        "populora_verl.rollout.engine_ports": ("env[VLLM_PORT_ENV] = str(base)",),
        "populora_verl.trainer.trainer": ('self.trainer_mode = "sync"',),
        "populora_verl.workers.resident_engine": (
            "engine.__class__ = ",
            "transformer_impl.prepare_micro_batches = _slot_micro_batches",
        ),
        "populora_verl.workers.lora_forward": ("cls.forward = lean_lora_forward",),
    }
    listed: dict[str, int] = {}
    for rp in verl_private.RUNTIME_PATCHES:
        listed[rp.module] = listed.get(rp.module, 0) + 1
    assert {module: len(m) for module, m in marks.items()} == listed
    for module, module_marks in marks.items():
        src = (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        for mark in module_marks:
            assert mark in src, (module, mark)
