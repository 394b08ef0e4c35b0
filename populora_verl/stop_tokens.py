"""Which token ids end a generation: the tokenizer's EOS *and* the model's ``generation_config.eos_token_id``.

Instruct models often disagree between the two: a converted Qwen2.5 instruct tokenizer says ``<|endoftext|>`` while
the model ends its turns with ``<|im_end|>`` (its generation config). Stopping on the tokenizer's EOS alone lets the
model run on past its answer, so every engine here (the CPU driver, the evaluation backends, the verl agent loop)
stops on the union.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["stop_token_ids", "load_generation_config"]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The tokenizer's EOS id first, then the generation config's EOS id(s), without duplicates."""
    out: list[int] = []
    for i in _ids(getattr(tokenizer, "eos_token_id", None)) + _ids(getattr(generation_config, "eos_token_id", None)):
        if i not in out:
            out.append(i)
    return out


def load_generation_config(model_path: str | os.PathLike | None) -> Any:
    """``GenerationConfig`` of a local model folder, or ``None`` (no folder, no ``generation_config.json``)."""
    if model_path is None or not os.path.isdir(os.path.expanduser(str(model_path))):
        return None  # a hub id: never download from here
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(os.path.expanduser(str(model_path)))
    except (OSError, ValueError):
        return None
