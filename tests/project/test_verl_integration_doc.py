"""docs/verl-integration.md lists exactly the runtime patches and private verl names of populora_verl/verl_private.py
(the list the drift test pins and proves complete), each with the patch that removes it."""

from __future__ import annotations

import re

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
    # variable): a cheap guard against a list entry that outlived its code.
    marks = {
        "populora_verl.workers.logprobs": "mod.logprobs_from_logits = ",
        "populora_verl.rollout.routing": "self.engine = LoraRoutingEngine(",
        "populora_verl.rollout.agent_loop": "self.server_manager = LoraInjectingClient(",
        "populora_verl.rollout.weight_sync": "os.environ[JOB_ID_ENV] = ",
        "populora_verl.rollout.server_adapter": "self.zmq_handle = rewrite_zmq_handle(",
        "populora_verl.trainer.trainer": 'self.trainer_mode = "sync"',
        "populora_verl.workers.resident_engine": "engine.__class__ = ",
        "populora_verl.workers.lora_forward": "cls.forward = lean_lora_forward",
    }
    assert set(marks) == {rp.module for rp in verl_private.RUNTIME_PATCHES}
    for module, mark in marks.items():
        assert mark in (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"), (module, mark)
