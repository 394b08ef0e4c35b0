"""Weight-space evolution of LoRA adapters.

Submodules (imported explicitly, nothing heavy is imported here):

- ``lora``: PEFT key pairing, batched factor stacks, factor <-> SVD utilities (QR + r x r SVD trick).
- ``operators``: the ``OPERATORS`` registry of mutations and crossovers (``register_operator``).
- ``retention``: child/parent retention test of the operators on an evaluation callable.
- ``pbt``: the population-based-training controller (when, who dies, who breeds, which operator).
"""
