"""The AZR task loop as AZR runs it (issue 10): one prompt tokenization for both engines, prompts and the
``tasks.prompt_file``, solver batches, the seeding phase, per-adapter compute counts and teacher-only diagnostics."""

from __future__ import annotations

import asyncio
import types

import pytest

from populora_verl.config import load_config
from populora_verl.step import GenRequest

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from populora_verl.local.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --- item 2: the azr template is raw text in both engines ------------------------------------------------


async def _verl_prompt_ids(tokenizer, rows, monkeypatch):
    """Prompt ids as verl's agent loop builds them for our rows (the real PopuLoRAAgentLoop.run and its
    ct_build_initial_tokens; only the generation after the prompt is left out)."""
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from populora_verl.rollout.agent_loop import PopuLoRAAgentLoop

    async def prompt_only_run(self, sampling_params, **kwargs):
        ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        return types.SimpleNamespace(extra_fields={"prompt_ids": ids})

    monkeypatch.setattr(SingleTurnAgentLoop, "run", prompt_only_run)
    loop = PopuLoRAAgentLoop.__new__(PopuLoRAAgentLoop)
    loop.tokenizer = tokenizer
    loop.loop = asyncio.get_running_loop()
    loop.rollout_config = types.SimpleNamespace(prompt_length=100_000)
    loop.continuous_token_builder = create_continuous_token_builder(tokenizer, hf_model_type=None)
    outs = [await loop.run({}, raw_prompt=r["raw_prompt"], populora=r["populora"]) for r in rows]
    return [o.extra_fields["prompt_ids"] for o in outs]


@pytest.mark.parametrize("template", ["azr", "chat"])
async def test_same_prompt_token_ids_in_cpu_driver_and_verl_agent_loop(tokenizer, template, monkeypatch):
    from populora_verl.local.config import load_local_config
    from populora_verl.local.hf_engine import HFEngine
    from populora_verl.step.task_env import TaskEnv
    from populora_verl.tasks import identity_task
    from populora_verl.trainer import convert

    import numpy as np

    cfg = load_config({"tasks": {"prompt_template": template}})
    env = TaskEnv(cfg, executor=object())
    rng = np.random.default_rng(0)
    requests = [GenRequest("a0", "teacher", t, env.proposer_request(t, rng)[0], 1, {}) for t in cfg.tasks.types]
    requests.append(GenRequest("a0", "student", "code_o", env.solver_request(identity_task("code_o")), 1,
                               {"task": identity_task("code_o")}))
    engine = HFEngine.__new__(HFEngine)
    engine.tokenizer, engine.cfg = tokenizer, load_local_config({"max_prompt_tokens": 100_000})
    cpu_ids = [engine._encode(r.prompt) for r in requests]

    rows = convert.requests_to_rows(requests, {"a0": {"slot": 0, "lora_int_id": 1000, "lora_name": "0@v0"}}, 1)
    verl_ids = await _verl_prompt_ids(tokenizer, rows, monkeypatch)
    assert verl_ids == cpu_ids
    if template == "azr":
        # Raw text: the ids decode to the prompt itself, which ends by opening the think block; no chat wrapping.
        assert all(tokenizer.decode(ids) == r.prompt for ids, r in zip(cpu_ids, requests))
        assert all(r.prompt.endswith("Assistant: <think>") for r in requests)
        assert all(row["populora"]["prompt_format"] == "text" for row in rows)
    else:
        assert tokenizer.decode(cpu_ids[0]).startswith("<|user|>")
