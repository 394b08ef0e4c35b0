"""A tiny Qwen2-architecture causal LM and a byte-level BPE tokenizer, built on the fly with no download.

The CPU driver's embedded default: the model is random (it writes garbage), which is exactly what the end-to-end
tests need — format penalties, invalid proposals, buffer fallbacks — at a cost of seconds on two cores. The
tokenizer is trained with ``tokenizers`` on a small embedded corpus of Python and AZR prompt text, so the vocabulary
covers fences, ``<think>``/``<answer>`` tags and Python keywords, and a trained-from-here model could in principle
learn the format.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["TINY_CORPUS", "build_tiny_tokenizer", "build_tiny_model", "build_tiny"]

EOS = "<|endoftext|>"

# Embedded training text for the tokenizer: short Python programs in AZR's style plus the prompt scaffolding.
TINY_CORPUS: tuple[str, ...] = (
    "def f(a):\n    return a\n",
    "def f(x):\n    return x * 2 + 1\n",
    "def f(s):\n    return s[::-1]\n",
    "def f(nums):\n    total = 0\n    for n in nums:\n        if n % 2 == 0:\n            total += n\n"
    "    return total\n",
    "def f(words):\n    return sorted(words, key=len)\n",
    "def f(d):\n    return {k: v for k, v in d.items() if v > 0}\n",
    "def f(n):\n    if n <= 1:\n        return n\n    return f(n - 1) + f(n - 2)\n",
    "def f(text, k):\n    out = []\n    for i, ch in enumerate(text):\n        if i % k == 0:\n"
    "            out.append(ch.upper())\n        else:\n            out.append(ch)\n    return ''.join(out)\n",
    "def f(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    "def f(lst):\n    seen = set()\n    result = []\n    for x in lst:\n        if x not in seen:\n"
    "            seen.add(x)\n            result.append(x)\n    return result\n",
    "def f(matrix):\n    return [list(row) for row in zip(*matrix)]\n",
    "import math\n\ndef f(x):\n    return math.floor(math.sqrt(abs(x)))\n",
    "from collections import Counter\n\ndef f(s):\n    return Counter(s).most_common(1)[0][0]\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n        self.next = None\n",
    "def f(x, y):\n    try:\n        return x // y\n    except ZeroDivisionError:\n        return None\n",
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the answer.\n",
    "User: Design a program and an input.\nAssistant: <think>Let me plan the program first.</think>\n"
    "<answer>\n```python\ndef f(a):\n    return a\n```\n```input\n'Hello world'\n```\n</answer>\n",
    "User: Predict the output of the program for the given input.\nAssistant: <think>The function returns its input."
    "</think>\n<answer>\n```output\n'Hello world'\n```\n</answer>\n",
    "User: Deduce an input that produces the output.\nAssistant: <think>Any input equal to the output works.</think>\n"
    "<answer>\n```input\n'Hello world', 3\n```\n</answer>\n",
    "User: Write the function from the input and output pairs.\n```message\nWrite a function that returns whatever "
    "you input\n```\nAssistant: <think>It is the identity.</think>\n<answer>\n```python\ndef f(a):\n    return a\n```\n"
    "</answer>\n",
    "Input: [1, 2, 3], Output: 6\nInput: 'abc', Output: 'cba'\nInput: {'a': 1}, Output: True\n",
    "# Input: (1, 2)\n# Output: 3\nNone True False 0 1 2 3 4 5 6 7 8 9 10 100 -1 0.5 [] {} () '' \"\"\n",
)


def build_tiny_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on :data:`TINY_CORPUS` (deterministic).

    The corpus is small, so the vocabulary stops short of ``vocab_size`` (~700 tokens): 256 bytes plus merges.
    """
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_trained_bpe(vocab_size), eos_token=EOS, pad_token=EOS, bos_token=None
    )
    fast.padding_side = "left"  # decoder-only generation pads on the left
    return fast


@functools.lru_cache(maxsize=4)
def _bpe_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so frequent Python bigrams win merges over one-off strings.
    tok.train_from_iterator(list(TINY_CORPUS) * 4, trainer=trainer)
    return tok.to_str()


def _trained_bpe(vocab_size: int) -> Any:
    # Training is deterministic; cache the result so tests building several drivers train once.
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_bpe_json(vocab_size))


def build_tiny_model(tokenizer: Any, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Any:
    """A randomly initialised Qwen2 causal LM sized to ``tokenizer`` (float32, eval mode)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    # Initialise under a private generator state so building the model does not disturb the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.float().eval()


def build_tiny(seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for the embedded default."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, seed=seed), tokenizer
