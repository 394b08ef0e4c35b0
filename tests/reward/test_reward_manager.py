"""The verl reward manager ``populora_code``: registration and run_single on hand-made DataProto objects
(no Ray: init_class + run_single are called directly, with the real sandboxed executor)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from populora_verl.reward import levels
from populora_verl.tasks import Task, identity_code_f_task

pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls  # noqa: E402
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase  # noqa: E402

from populora_verl.reward.manager import EXTRA_KEYS, PopuLoRACodeRewardManager, register  # noqa: E402


class CharTokenizer:
    """One token per character (ids = code points); 0 is padding. Enough for decode()."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) != 0)


def make_item(response: str, info: dict, prompt: str = "User: q\nAssistant: <think>", resp_len: int = 1200,
              as_json: bool = False) -> DataProto:
    tok = CharTokenizer()
    p, r = tok.encode(prompt), tok.encode(response)
    assert len(r) <= resp_len
    prompts = torch.tensor([p])
    responses = torch.zeros(1, resp_len, dtype=torch.long)
    responses[0, : len(r)] = torch.tensor(r, dtype=torch.long)
    mask = torch.zeros(1, len(p) + resp_len, dtype=torch.long)
    mask[0, : len(p) + len(r)] = 1
    field = json.dumps(info) if as_json else info
    return DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
                               non_tensors={"populora": np.array([field], dtype=object)})


def wrap(answer: str) -> str:
    return f"thinking</think><answer>\n{answer}\n</answer>"


@pytest.fixture(scope="module")
def manager():
    register()
    PopuLoRACodeRewardManager.reset_class()
    config = OmegaConf.create({"populora": {"executor": {"timeout_s": 2.0, "max_workers": 2},
                                            "rewards": {"zero_learnability_reward": 0.0}}})
    m = PopuLoRACodeRewardManager(config=config, tokenizer=CharTokenizer(), compute_score=None)
    yield m
    PopuLoRACodeRewardManager.reset_class()


def test_register_is_idempotent_and_visible_to_verl():
    cls = register()
    assert register() is cls
    assert get_reward_manager_cls("populora_code") is PopuLoRACodeRewardManager
    assert issubclass(cls, RewardManagerBase)


async def test_init_class_reads_the_populora_section(manager):
    assert PopuLoRACodeRewardManager.cfg.executor.timeout_s == 2.0
    assert PopuLoRACodeRewardManager.cfg.rewards.zero_learnability_reward == 0.0
    ex = PopuLoRACodeRewardManager._get_executor()  # started on first use
    assert ex is not None and PopuLoRACodeRewardManager._get_executor() is ex
    PopuLoRACodeRewardManager.init_class(None, None)  # second call: no new executor
    assert PopuLoRACodeRewardManager.executor is ex


async def test_rows_scored_by_the_population_step_are_deferred(manager, monkeypatch):
    """The populora trainer scores in the step: the manager must neither decode nor execute those rows."""
    calls = []
    monkeypatch.setattr(PopuLoRACodeRewardManager, "_get_executor", classmethod(lambda cls: calls.append(1)))
    monkeypatch.setattr(manager, "_decode", lambda item: calls.append("decode") or "")
    info = {"role": "propose", "task_type": "code_o", "adapter": "t0", "step": 3, "scored_by": "population_step"}
    out = await manager.run_single(make_item(wrap("```python\ndef f(a):\n    return a\n```"), info))
    assert out["reward_score"] == 0.0 and out["reward_extra_info"]["populora_status"] == "deferred"
    assert set(out["reward_extra_info"]) == set(EXTRA_KEYS) and calls == []


@pytest.mark.parametrize("role", ["teacher", "student", "seed"])
async def test_every_row_the_trainer_builds_is_deferred(manager, role):
    """The rows of all three generation phases (teachers, students, the seeding phase's base-policy proposals), as
    convert.requests_to_rows builds them, are accepted and deferred (on the H100 the seeding rows were rejected)."""
    from populora_verl.step import GenRequest
    from populora_verl.step.records import BASE_POLICY
    from populora_verl.trainer import convert

    task = Task(type="code_o", program="def f(a):\n    return a\n", input="1", output="1")
    adapter = BASE_POLICY if role == "seed" else "t0"
    req = GenRequest(adapter, role, "code_o", "prompt", 1, {"task": task, "program": None})
    row = convert.requests_to_rows([req], {adapter: {"slot": 0, "lora_int_id": 1000, "lora_name": "0@v0"}}, 1)[0]
    out = await manager.run_single(make_item("anything", row["populora"]))
    assert out["reward_score"] == 0.0 and out["reward_extra_info"]["populora_status"] == "deferred"


async def test_teacher_proposals(manager):
    prop = wrap("```python\ndef g(a, b):\n    return a * b + 1\n```\n```input\n3, 4\n```")
    out = await manager.run_single(make_item(prop, {"role": "propose", "task_type": "code_o", "adapter": "t2",
                                                    "step": 5}))
    extra = out["reward_extra_info"]
    assert tuple(extra) == EXTRA_KEYS
    assert out["reward_score"] == 0.0 and extra["populora_status"] == "valid" and extra["populora_valid"] == 1.0
    task = Task.from_json(extra["populora_task"])
    assert (task.output, task.teacher, task.step, task.id) == ("13", "t2", 5, extra["populora_task_id"])
    assert "def f(a, b):" in task.program

    bad = wrap("```python\nimport time\ndef f(a):\n    return time.time()\n```\n```input\n1\n```")
    out = await manager.run_single(make_item(bad, {"role": "teacher", "task_type": "code_i", "adapter": "t2"}))
    assert out["reward_score"] == -1.0 and out["reward_extra_info"]["populora_status"] == "invalid"
    assert out["reward_extra_info"]["populora_task"] == "" and tuple(out["reward_extra_info"]) == EXTRA_KEYS

    out = await manager.run_single(make_item("no envelope here", {"role": "propose", "task_type": "code_i"}))
    assert out["reward_score"] == -1.0 and out["reward_extra_info"]["populora_status"] == "format_error"


async def test_code_f_proposal_needs_the_shown_program(manager):
    program = Task(type="code_o", program="def f(x):\n    return x * x\n", input="2", output="4")
    inputs = "\n".join(f"```input\n{i}\n```" for i in range(1, 11))  # AZR's rule: all num_inputs=10
    text = wrap(inputs + "\n```message\nsquares\n```")
    info = {"role": "propose", "task_type": "code_f", "adapter": "t0", "task": program.to_json()}
    out = await manager.run_single(make_item(text, info, as_json=True))
    t = Task.from_json(out["reward_extra_info"]["populora_task"])
    assert t.outputs == [str(i * i) for i in range(1, 11)] and t.num_visible == 5
    with pytest.raises(ValueError, match="task is required"):
        await manager.run_single(make_item(text, {"role": "propose", "task_type": "code_f"}))


async def test_student_answers_and_teacher_assembly(manager):
    task = Task(type="code_o", program="def f(a):\n    return a[::-1]\n", input="[1, 2, 3]", output="[3, 2, 1]",
                teacher="t0")
    info = {"role": "solve", "task_type": "code_o", "adapter": "s1", "task": task.to_dict()}
    answers = ["```output\n[3, 2, 1]\n```", "```output\n[3,2,1]\n```", "```output\n[1, 2, 3]\n```", None]
    outs = []
    for a in answers:
        text = wrap(a) if a is not None else "garbage without tags"
        outs.append(await manager.run_single(make_item(text, info)))
    assert [o["reward_score"] for o in outs] == [1.0, 1.0, -0.5, -1.0]
    assert [o["reward_extra_info"]["populora_status"] for o in outs] == ["correct", "correct", "wrong",
                                                                         "format_error"]
    assert all(tuple(o["reward_extra_info"]) == EXTRA_KEYS for o in outs)
    # Driver side: the matched student's correctness gives the teacher's learnability (Z = 0 in this config).
    correct = [o["reward_extra_info"]["populora_correct"] for o in outs]
    r = levels.teacher_reward("valid", levels.solve_rate(correct), PopuLoRACodeRewardManager.cfg.rewards)
    assert r == pytest.approx(0.5)


async def test_code_f_student_and_rm_scores(manager):
    task = identity_code_f_task()
    info = {"role": "student", "task_type": "code_f", "adapter": "s0", "task": task.to_json()}
    right = await manager.run_single(make_item(wrap("```python\ndef f(a):\n    return a\n```"), info))
    wrong = await manager.run_single(make_item(wrap("```python\ndef f(a):\n    return repr(a)\n```"), info))
    assert (right["reward_score"], wrong["reward_score"]) == (1.0, -0.5)
    # verl places each score on the last valid response token.
    batch = DataProto.concat([make_item("abc", info, resp_len=8), make_item("abcdef", info, resp_len=8)])
    rm = PopuLoRACodeRewardManager.assemble_rm_scores(batch, [1.0, -0.5])
    assert rm[0, 2] == 1.0 and rm[1, 5] == -0.5 and rm.abs().sum() == 1.5


async def test_bad_metadata_is_a_clear_error(manager):
    with pytest.raises(ValueError, match="role"):
        await manager.run_single(make_item("x", {"role": "judge", "task_type": "code_o"}))
    with pytest.raises(ValueError, match="task_type"):
        await manager.run_single(make_item("x", {"role": "solve", "task_type": "code_z"}))
