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


def test_a_gguf_is_parsed_once_and_its_tensors_read_as_plain_arrays(tmp_path, monkeypatch):
    """transformers opens one GGUF four times per conversion (tokenizer, config, weights): within the conversion the
    file is parsed once, its tensors are plain arrays over the same bytes (no memmap slicing cost), the values are
    the file's, and the reader is the library's own again afterwards."""
    import gguf
    import numpy as np

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    values = np.arange(64, dtype=np.float32).reshape(2, 32) / 7
    w.add_tensor("blk.0.attn_q.weight", gguf.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parses = []
    original = gguf.GGUFReader

    class Counting(original):
        def __init__(self, *a, **k):
            parses.append(a)
            super().__init__(*a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    with models._gguf_parsed_once():
        first, again = gguf.GGUFReader(str(path)), gguf.GGUFReader(path)
        assert first is again and len(parses) == 1
        (t,) = first.tensors
        assert type(t.data) is np.ndarray and type(first.data) is np.ndarray  # not np.memmap, for tensors and fields
        got = gguf.dequantize(t.data, t.tensor_type)
    assert gguf.GGUFReader is Counting
    (ref,) = original(str(path)).tensors
    assert isinstance(ref.data, np.memmap)
    assert np.array_equal(got, gguf.dequantize(ref.data, ref.tensor_type))
    assert np.allclose(got, values, atol=0.04)  # Q8_0: half a step of max|x| / 127


def test_threads_dequantize_ahead_of_the_loop_with_the_serial_values(tmp_path, monkeypatch):
    """With workers > 1 each tensor of transformers' file-order loop comes from a thread pool that works a bounded
    window ahead: the values are the serial ones, a tensor is dequantised once, and the pool is shut on exit."""
    import threading

    import gguf
    import numpy as np

    path = tmp_path / "many.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    rng = np.random.default_rng(0)
    for i in range(12):
        w.add_tensor(f"blk.0.t{i}.weight", gguf.quantize(rng.normal(size=(4, 64)).astype(np.float32),
                                                         gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.norm.weight", np.ones(64, dtype=np.float32))  # F32: the pool passes it through as well
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    serial = [gguf.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors]

    calls, threads = [], set()
    original = gguf.dequantize

    def counting(data, qtype):
        calls.append(id(data))
        threads.add(threading.current_thread().name)
        return original(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", counting)
    with models._gguf_parsed_once(workers=2):
        reader = gguf.GGUFReader(str(path))
        ahead = gguf.dequantize  # the pooled one while the context lasts
        first = ahead(reader.tensors[0].data, reader.tensors[0].tensor_type)
        assert len(calls) <= 1 + 4  # the first call submits the tensor and a window of 2 x workers behind it
        got = [first] + [ahead(t.data, t.tensor_type) for t in reader.tensors[1:]]
        stray = np.zeros((2, 34), dtype=np.uint8)  # an array the reader does not hold: dequantised in place
        assert ahead(stray, gguf.GGMLQuantizationType.Q8_0).shape == (2, 32)
    assert gguf.dequantize is counting  # the library's function again
    assert all(np.array_equal(a, b) for a, b in zip(got, serial, strict=True))
    assert sorted(calls[:13]) == sorted(id(t.data) for t in reader.tensors)  # each tensor once, then the stray
    assert any(name.startswith("gguf-dequantize") for name in threads)
    assert models.dequantize_workers() >= 1
    assert models.main(["convert", str(path), str(tmp_path / "out"), "--workers", "0"]) == 2  # one-line usage error


def test_conversion_bench_alternates_settings_and_flags_different_weights(tmp_path, monkeypatch, capsys):
    from populora_verl.bench import convert as bench

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    seen = []

    def fake_round(path, out, workers, dtype, checkout=None):
        seen.append(workers if checkout is None else checkout.name)
        return (10.0 if checkout is not None else 5.0 if workers == 4 else 8.0), "same"

    old = tmp_path / "old"
    (old / "populora_verl").mkdir(parents=True)
    (old / "populora_verl" / "models.py").write_text("")
    monkeypatch.setattr(bench, "run_round", fake_round)
    assert bench.main([str(gguf), "--workers", "1", "4", "--rounds", "2", "--against", str(old)]) == 0
    assert seen == ["old", 1, 4, 4, 1, "old"]  # the other checkout is the reference; the order alternates
    out = capsys.readouterr().out
    assert "| workers 4 | 5.0 | 5.0-5.0 | 0.50 |" in out and "identical across settings and rounds: yes" in out
    with pytest.raises(SystemExit):
        bench.main([str(gguf), "--against", str(tmp_path)])  # not a checkout
    monkeypatch.setattr(bench, "run_round", lambda p, o, w, d, c=None: (1.0, f"digest-{w}"))
    assert bench.main([str(gguf), "--workers", "1", "2", "--rounds", "1"]) == 1  # different weights: a failure
    with pytest.raises(SystemExit):
        bench.main([str(gguf), "--workers", "2", "2"])
    assert not list(tmp_path.glob(".bench-convert.*"))  # the scratch folder is removed
