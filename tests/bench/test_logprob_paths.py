"""populora_verl.bench.logprob_paths: verl's per-token log-prob fallback against vectorised paths."""

from __future__ import annotations

import os
import socket
import sys
from contextlib import ExitStack

import pytest
import torch
from _shared import finished, run_side_by_side

from populora_verl.bench import logprob_paths as lp


def test_every_path_agrees_with_the_others_and_is_timed():
    times = lp.run(tokens=64, vocab=97, hidden=16, rounds=2, device="cpu", dtype=torch.float32)
    assert set(times) == set(lp.PATHS) and all(len(v) == 2 and min(v) > 0 for v in times.values())
    text = lp.report(times, 64, "cpu")
    assert lp.verl_uses_flash_ce() is False  # no flash_attn package here (nor in our GPU bundle)
    assert "| verl_fallback |" in text and text.count("| 1.000 |") == 1  # the fallback is the reference


def test_the_fallback_loops_once_per_token(monkeypatch):
    """The diagnosis the bench rests on: verl's fallback calls a per-row op once per packed token."""
    from verl.utils import torch_functional as verl_F

    calls = {"n": 0}
    real = torch.nn.functional.log_softmax

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(verl_F.F, "log_softmax", counting)
    logits = torch.randn(37, 11, dtype=torch.bfloat16)
    verl_F.logprobs_from_logits_v2(logits, torch.randint(0, 11, (37,)))
    assert calls["n"] == 37


def test_paths_disagreeing_is_an_error(monkeypatch):
    monkeypatch.setitem(lp.PATHS, "vectorised", lambda h, w, y: lp._vectorised(h, w, y) + 1.0)
    with pytest.raises(AssertionError):
        lp.run(tokens=8, vocab=13, hidden=4, rounds=1, device="cpu", dtype=torch.float32)


def test_cli_rejects_unknown_paths_and_bad_sizes():
    with pytest.raises(SystemExit):
        lp.main(["--paths", "nope"])
    with pytest.raises(SystemExit):
        lp.main(["--tokens", "0"])


_FUSED_UNDER_PEFT = r'''
import torch, warnings
warnings.filterwarnings("ignore")
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch

torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
cfg._attn_implementation = "sdpa"
model = Qwen2ForCausalLM(cfg)
# as verl's FSDP engine builds the actor: patch the HF model, then wrap it with PEFT
apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               init_lora_weights=False))
ids = torch.randint(0, 97, (1, 20))
pos = torch.arange(20).unsqueeze(0)
out = peft_model(input_ids=ids, position_ids=pos, temperature=1.0, return_dict=True)
with torch.no_grad():  # the reference: full logits from the same LoRA model, log_softmax, gather
    hidden = peft_model.base_model.model.model(input_ids=ids, position_ids=pos).last_hidden_state
    logits = peft_model.base_model.model.lm_head(hidden).float()
    expected = logits.log_softmax(-1).gather(-1, torch.roll(ids, -1, dims=1).unsqueeze(-1)).squeeze(-1)
torch.testing.assert_close(out.log_probs, expected, rtol=1e-5, atol=1e-5)
out.log_probs.sum().backward()
lora = [p for n, p in peft_model.named_parameters() if "lora_" in n]
assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora), "a LoRA matrix got no gradient"
print("FUSED_OK", len(lora))
'''


def test_verls_fused_lm_head_path_works_under_peft_lora(own_processes):
    """--profile fused rests on this: verl's use_fused_kernels (torch backend) patches the HF model that PEFT then
    wraps; log-probs must equal the logits path and every LoRA matrix must train. Own process: verl's patch replaces
    the model class's forward for the whole interpreter."""
    res = finished(own_processes["peft"])
    assert res.returncode == 0 and "FUSED_OK 28" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


_FUSED_UNDER_FSDP2 = r'''
import os, sys, torch, warnings
warnings.filterwarnings("ignore")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", sys.argv[2])
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.utils.fsdp_utils import apply_fsdp2
tie = sys.argv[1] == "tied"
cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie)
cfg._attn_implementation = "sdpa"
model = Qwen2ForCausalLM(cfg)
apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
apply_fsdp2(pm, {"mesh": mesh, "reshard_after_forward": True}, {})
ids = torch.randint(0, 97, (1, 20)); pos = torch.arange(20).unsqueeze(0)
try:
    out = pm(input_ids=ids, position_ids=pos, temperature=1.0, return_dict=True)
    print("OK", tuple(out.log_probs.shape))
except Exception as e:
    print("FAIL", type(e).__name__, str(e)[:200])
'''


HEADS = [("tied", "OK"), ("untied", "FAIL RuntimeError aten.mm.default got mixed")]


@pytest.fixture(scope="module")
def own_processes():
    """The fresh interpreters of this module's verl checks, side by side: "peft", and each head of :data:`HEADS` on a
    free port of its own (both ports held while they are picked, so the two differ; an inherited MASTER_ADDR or
    MASTER_PORT would make the two gloo groups meet) -> the finished process."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    with ExitStack() as stack:
        ports = {}
        for head, _ in HEADS:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports[head] = str(s.getsockname()[1])
    jobs = {"peft": {"args": [sys.executable, "-c", _FUSED_UNDER_PEFT]}}
    jobs.update({head: {"args": [sys.executable, "-c", _FUSED_UNDER_FSDP2, head, ports[head]], "env": env}
                 for head, _ in HEADS})
    return run_side_by_side(jobs)


@pytest.mark.parametrize("head,expect", HEADS)
def test_fused_kernels_under_fsdp2_need_a_tied_head(head, expect, own_processes):
    """What the H100 run showed for our untied 1.5B checkpoint, on CPU: verl wraps an untied lm_head as its own FSDP2
    unit, and the fused forward reads its weight while it is still a DTensor. The start-up check
    (populora_verl.startup._check_fused_kernels) rests on this; if verl fixes it, this test says so."""
    res = finished(own_processes[head])
    assert expect in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
