"""``attn_implementation=populora_varlen`` on CPU: a packed row (verl's remove-padding input) gives the same logits
per sequence as running each sequence alone with sdpa (the boundary rule and the layout; the CUDA kernel itself is
torch's and runs only on the GPU)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from populora_verl.workers import varlen_attention as va  # noqa: E402


def test_cu_seqlens_from_restarting_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    cu, longest = va.cu_seqlens(pos)
    assert cu.tolist() == [0, 3, 5, 6, 10] and cu.dtype == torch.int32 and longest == 4
    cu, longest = va.cu_seqlens(torch.tensor([[5, 6, 7]]))  # one sequence not starting at 0 (a shifted window)
    assert cu.tolist() == [0, 3] and longest == 3


def test_packed_row_matches_each_sequence_alone(monkeypatch):
    va.register()
    calls = []
    real = va._reference_varlen
    monkeypatch.setattr(va, "_reference_varlen", lambda *a: calls.append(a[3].tolist()) or real(*a))
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                   num_hidden_layers=2, vocab_size=100, attn_implementation="sdpa")
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    seqs = [torch.randint(0, 100, (n,)) for n in (7, 3, 11)]
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        model.config._attn_implementation = va.NAME
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = va.NAME
        packed = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        out = model(input_ids=packed, position_ids=pos).logits[0]
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-4, atol=1e-4)
    assert calls == [[0, 7, 10, 21]] * 2  # our function ran in both layers, with the three sequences


def test_model_builds_with_the_registered_name_and_trains():
    va.register()
    cfg = transformers.Qwen2Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
                                   num_hidden_layers=1, vocab_size=50)
    cfg._attn_implementation = va.NAME
    model = transformers.Qwen2ForCausalLM(cfg)
    ids = torch.randint(0, 50, (1, 9))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    # not one packed row: sdpa's own path
    out = model(input_ids=torch.randint(0, 50, (2, 5)), attention_mask=torch.ones(2, 5, dtype=torch.long)).logits
    assert out.shape == (2, 5, 50)
