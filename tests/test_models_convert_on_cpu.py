"""GGUF -> HF conversion around transformers' GGUF loader (a stand-in loader here: no GGUF file is built): the
weights come out in the asked dtype, the quantisation marker is gone, and the folder appears whole, replacing an
older one, with no temporary folder left beside it."""

from __future__ import annotations

import json

import pytest
import torch

from populora_verl import models


class _Tok:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


@pytest.fixture
def gguf_stand_in(tmp_path, monkeypatch):
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)
    loaded = Qwen2ForCausalLM(cfg)
    loaded.config.quantization_config = {"quant_method": "gguf"}  # what transformers' GGUF loader marks
    calls = []

    def from_pretrained(folder, **kw):
        calls.append(kw)
        assert kw["gguf_file"] == "m.gguf" and kw["dtype"] == torch.float32
        return loaded

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda folder, **kw: _Tok())
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    return tmp_path / "m.gguf", loaded, calls


def test_conversion_writes_a_whole_folder_in_the_dtype_and_replaces_an_old_one(tmp_path, gguf_stand_in):
    from safetensors.torch import load_file

    gguf, loaded, calls = gguf_stand_in
    out = tmp_path / "models" / "qwen"
    out.mkdir(parents=True)
    (out / "stale.bin").write_text("from an older conversion")
    assert models.gguf_to_hf(gguf, out, dtype="bfloat16") == out
    assert len(calls) == 1  # the GGUF is parsed once for the weights (the config comes from the loaded model)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype" if "torch_dtype" in config else "dtype"] \
        == "bfloat16"
    weights = load_file(out / "model.safetensors")
    for name, p in loaded.state_dict().items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], p.to(torch.bfloat16))
    assert [p.name for p in out.parent.iterdir()] == ["qwen"]  # no temporary folder left next to it
