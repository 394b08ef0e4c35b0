"""Every engine stops on the model's chat end token (generation_config) as well as the tokenizer's EOS.

The fixture is the converted-Qwen situation: the tokenizer's EOS is ``<|endoftext|>``, the model's
generation_config ends turns with ``<|im_end|>``.
"""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
import torch

from populora_verl.stop_tokens import load_generation_config, stop_token_ids

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """``(model, tokenizer, folder, eos_id, im_end_id)``: tokenizer EOS != generation_config EOS."""
    from populora_verl.local.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IM_END]})
    model = build_tiny_model(tok)
    im_end = tok.convert_tokens_to_ids(IM_END)
    model.generation_config.eos_token_id = im_end
    assert tok.eos_token_id != im_end
    folder = tmp_path_factory.mktemp("chat_model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok, folder, tok.eos_token_id, im_end


def test_stop_ids_are_the_union(chat_model):
    _, tok, folder, eos, im_end = chat_model
    gen = load_generation_config(folder)
    assert gen.eos_token_id == im_end
    assert stop_token_ids(tok, gen) == [eos, im_end]
    assert stop_token_ids(tok, types.SimpleNamespace(eos_token_id=[im_end, eos])) == [eos, im_end]
    assert stop_token_ids(tok, None) == [eos]
    assert load_generation_config("Qwen/Qwen2.5-Coder-7B") is None  # a hub id is never fetched


def _fake_generate(calls, tail):
    def generate(input_ids, **kwargs):
        calls.append(kwargs)
        extra = torch.tensor([tail] * input_ids.shape[0])
        return torch.cat([input_ids, extra], dim=1)
    return generate


def test_cpu_driver_engine_stops_at_the_chat_end_token(chat_model, monkeypatch):
    from populora_verl.local.config import LocalConfig
    from populora_verl.local.hf_engine import HFEngine
    from populora_verl.step import GenRequest

    model, tok, _, eos, im_end = chat_model
    engine = HFEngine(model, tok, num_slots=1, cfg=LocalConfig(), temperature=0.0, max_new_tokens=8)
    word = tok("x = 1", add_special_tokens=False)["input_ids"]
    calls = []
    monkeypatch.setattr(engine.model, "generate", _fake_generate(calls, word + [im_end] + word + [eos]))
    out = engine.generate([GenRequest("t0", "teacher", "code_o", "def f(x):", 1)], lambda _: engine.slots[0], seed=0)
    assert calls[0]["eos_token_id"] == [eos, im_end]
    prompt_ids, resp = out[0].extra[0]
    assert resp == word + [im_end]  # cut at the chat end token, which is kept (the policy learns to stop)
    assert out[0].texts[0] == "x = 1"


def test_eval_hf_backend_stops_at_the_chat_end_token(chat_model, monkeypatch):
    from populora_verl.eval.backends import HFBackend, Member

    _, _, folder, eos, im_end = chat_model
    backend = HFBackend(str(folder), [Member("base")], max_new_tokens=4, dtype="float32", device="cpu")
    assert backend.stop_ids == [eos, im_end]
    calls = []
    monkeypatch.setattr(backend.model, "generate", _fake_generate(calls, [im_end, im_end]))
    backend.generate(["def f(x):"], [Member("base")])
    assert calls[0]["eos_token_id"] == [eos, im_end]


def test_eval_vllm_backend_passes_stop_token_ids(chat_model, monkeypatch):
    from populora_verl.eval.backends import Member, VLLMBackend

    _, tok, folder, eos, im_end = chat_model
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs

        def get_tokenizer(self):
            return tok

    class SamplingParams:
        def __init__(self, **kwargs):
            seen["params"] = kwargs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    VLLMBackend(str(folder), [Member("base")], max_new_tokens=4)
    assert seen["params"]["stop_token_ids"] == [eos, im_end]


def test_verl_agent_loop_adds_the_chat_end_token(chat_model, monkeypatch):
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from populora_verl.rollout.agent_loop import PopuLoRAAgentLoop, _stop_ids

    _, tok, folder, eos, im_end = chat_model
    loop = PopuLoRAAgentLoop.__new__(PopuLoRAAgentLoop)
    loop.tokenizer = tok
    loop.stop_ids = _stop_ids(tok, OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(folder)}}}))
    seen = {}

    async def run(self, sampling_params, **kwargs):
        seen.update(sampling_params)
        return types.SimpleNamespace(extra_fields={})

    monkeypatch.setattr(SingleTurnAgentLoop, "run", run)
    asyncio.run(loop.run({"temperature": 1.0, "stop_token_ids": [7]}, populora={"lora_int_id": 3}))
    assert seen == {"temperature": 1.0, "stop_token_ids": [7, eos, im_end]}


def test_eval_generation_shows_progress_on_a_terminal(chat_model, monkeypatch):
    """populora-eval's HF generation draws a tqdm bar on a terminal (and nothing in a log file)."""
    import io

    from populora_verl.eval.backends import HFBackend, Member

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    _, _, folder, _, im_end = chat_model
    backend = HFBackend(str(folder), [Member("base")], max_new_tokens=2, dtype="float32", device="cpu", batch_size=2)
    monkeypatch.setattr(backend.model, "generate", _fake_generate([], [im_end]))
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    backend.generate(["a", "b", "c"], [Member("base"), Member("again")])
    assert "generate" in term.getvalue() and "6/6" in term.getvalue()
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    backend.generate(["a"], [Member("base")])
    assert log.getvalue() == ""


def test_verl_agent_loop_adds_no_stop_ids_when_eos_is_ignored(chat_model, monkeypatch):
    """rollout.ignore_eos (step_scaling's forced answer lengths): vLLM would still stop on the extra stop ids, so the
    loop must not add them (found on the H100: forced 1,024-token answers came back ~240 tokens long)."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from populora_verl.rollout.agent_loop import PopuLoRAAgentLoop, _stop_ids

    _, tok, folder, eos, im_end = chat_model
    cfg = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(folder)}, "rollout": {"ignore_eos": True}}})
    loop = PopuLoRAAgentLoop.__new__(PopuLoRAAgentLoop)
    loop.tokenizer, loop.config = tok, cfg
    loop.stop_ids = _stop_ids(tok, cfg)
    assert loop.stop_ids == [eos, im_end]
    seen = []

    async def run(self, sampling_params, **kwargs):
        seen.append(dict(sampling_params))
        return types.SimpleNamespace(extra_fields={})

    monkeypatch.setattr(SingleTurnAgentLoop, "run", run)
    asyncio.run(loop.run({"temperature": 1.0}, populora={"lora_int_id": 3}))
    asyncio.run(loop.run({"temperature": 1.0, "ignore_eos": False}, populora={"lora_int_id": 3}))
    assert seen == [{"temperature": 1.0}, {"temperature": 1.0, "ignore_eos": False, "stop_token_ids": [eos, im_end]}]
