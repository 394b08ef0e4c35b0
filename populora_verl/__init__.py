"""PopuLoRA for verl: a population of LoRA adapters on one frozen base model, co-evolved by self-play.

Heavy dependencies (torch, verl, vLLM, transformers) are imported lazily by the submodules that need them, so
``import populora_verl`` is cheap and works without a GPU.
"""

__version__ = "0.1.0"
