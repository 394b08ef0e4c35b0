"""The single-process CPU driver: ``python -m populora_verl.local`` (see docs/cpu-driver.md).

Runs the shared population step (:mod:`populora_verl.step`) with HF transformers + PEFT mixed-adapter batches on
an embedded tiny model (no download), a local HF model folder (``--model``) or a GGUF file (``--gguf``).
"""

from populora_verl.local.config import LocalConfig, load_local_config

__all__ = ["LocalConfig", "load_local_config", "LocalDriver", "build_configs", "main"]


def __getattr__(name: str):  # torch / transformers only when the driver is used
    if name == "LocalDriver":
        from populora_verl.local.driver import LocalDriver

        return LocalDriver
    if name in ("main", "build_configs"):
        from populora_verl.local import __main__ as cli

        return getattr(cli, name)
    raise AttributeError(name)
