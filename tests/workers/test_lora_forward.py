"""The trainer's lean LoRA forward computes what PEFT's does, with fewer ops, and steps aside for every other case."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from populora_verl.workers import lora_forward as lf

peft = pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _restore_peft():
    was = lf.installed()
    yield
    lf.install("lean" if was else "peft")


def _tiny_lora(seed: int = 0, **lora_kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=97, max_position_embeddings=64)
    kw = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"} | lora_kw  # scaling 2: the multiply matters
    model = peft.get_peft_model(Qwen2ForCausalLM(cfg), peft.LoraConfig(**kw))
    with torch.no_grad():  # PEFT starts B at zero; a trained adapter does not
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids).logits
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


@pytest.mark.parametrize("lora_kw", [{}, {"lora_alpha": 4}])
def test_lean_forward_matches_peft_in_outputs_and_gradients(lora_kw):
    model = _tiny_lora(**lora_kw)
    ids = torch.randint(0, 97, (2, 7))
    lf.install("peft")
    want_out, want_grads = _loss_and_grads(model, ids)
    assert lf.install("lean") and lf.installed()
    got_out, got_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    assert set(got_grads) == set(want_grads) and len(got_grads) == 2 * 2 * 7  # A and B of 7 layers x 2 blocks
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_lean_forward_under_bf16_autocast_stays_close_to_peft():
    model = _tiny_lora(1)
    ids = torch.randint(0, 97, (1, 9))
    outs = []
    for mode in ("peft", "lean"):
        lf.install(mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(model(input_ids=ids).logits.float())
    assert outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)  # bf16: PEFT rounds the multiply, we don't


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _count_ops(model, ids) -> Counter:
    model.zero_grad(set_to_none=True)  # else the second run adds into .grad
    with _OpCount() as c:
        model(input_ids=ids).logits.sum().backward()
    return c.ops


@pytest.mark.parametrize("alpha", [8, 4])  # scaling 2 and 1
def test_the_short_path_fuses_the_adapters_add_into_its_matmul(alpha):
    model = _tiny_lora(2, lora_alpha=alpha)
    ids = torch.randint(0, 97, (1, 5))
    lf.install("peft")
    peft_ops = _count_ops(model, ids)
    lf.install("lean")
    lean_ops = _count_ops(model, ids)
    layers = 2 * 7
    assert lean_ops["aten.addmm"] == peft_ops["aten.addmm"] + layers  # each LoRA layer's add rides in its matmul
    adds = lambda ops: ops["aten.add"] + ops["aten.add_"]  # noqa: E731
    assert adds(peft_ops) - adds(lean_ops) == layers  # the forward's add
    # the scaling: PEFT multiplies forward and backward even by 1; addmm's alpha does it in the epilogue forward, and
    # its backward multiplies only when alpha is not 1
    assert peft_ops["aten.mul"] - lean_ops["aten.mul"] == (2 * layers if alpha == 4 else 0)
    assert sum(lean_ops.values()) < sum(peft_ops.values())


@pytest.mark.parametrize("case", ["dropout", "lora_bias", "dora", "disabled", "merged", "two_adapters", "mixed_dtype"])
def test_every_other_case_computes_what_peft_computes(case):
    kw = {"dropout": {"lora_dropout": 0.1}, "lora_bias": {"lora_bias": True}, "dora": {"use_dora": True}}.get(case, {})
    model = _tiny_lora(3, **kw)
    model.eval()  # dropout off, so both forwards are deterministic (the module is still not Identity)
    if case == "two_adapters":
        model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=2, target_modules="all-linear"))
        model.base_model.set_adapter(["default", "other"])
    if case == "mixed_dtype":  # base in bf16, adapters kept in fp32, no autocast: PEFT promotes, then casts back
        for n, p in model.named_parameters():
            if "lora_" not in n:
                p.data = p.data.to(torch.bfloat16)
    ids = torch.randint(0, 97, (1, 6))

    def run():
        if case == "disabled":
            with model.disable_adapter():
                return model(input_ids=ids).logits
        if case == "merged":
            m = copy.deepcopy(model)
            m.merge_adapter()
            return m(input_ids=ids).logits
        return model(input_ids=ids).logits

    lf.install("peft")
    want = run().detach()
    lf.install("lean")
    got = run().detach()
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if case not in ("disabled", "merged"):  # states of the call, not of the layer
        short = lf._short_path(next(m for m in model.modules() if isinstance(m, peft.tuners.lora.Linear)), (), {})
        assert (short is not None) is (case == "mixed_dtype")  # mixed dtypes: the short path, PEFT's arithmetic


def test_install_reads_the_environment_and_refuses_unknown_modes(monkeypatch):
    monkeypatch.delenv(lf.ENV, raising=False)
    lf.install("lean")
    assert lf.install() is False and not lf.installed()  # PEFT's forward is the default (and undoes an install)
    monkeypatch.setenv(lf.ENV, "peft")
    assert lf.install() is False and not lf.installed()
    monkeypatch.setenv(lf.ENV, "lean")
    assert lf.install() is True and lf.install() is True and lf.installed()  # idempotent
    assert peft.tuners.lora.Linear.forward is lf.lean_lora_forward
    lf.uninstall()
    assert peft.tuners.lora.Linear.forward is not lf.lean_lora_forward and not lf.installed()
    monkeypatch.setenv(lf.ENV, "fast")
    with pytest.raises(ValueError, match="POPULORA_LORA_FORWARD must be one of"):
        lf.install()
