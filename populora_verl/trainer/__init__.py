"""The verl trainer ``populora`` (:mod:`populora_verl.trainer.trainer`) and its pure helpers (:mod:`.convert`).

:func:`register` imports verl's V1 trainer (TransferQueue, Ray) only when called.
"""

from __future__ import annotations

__all__ = ["register", "TRAINER_NAME"]

TRAINER_NAME = "populora"


def register():
    """Register ``PopuLoRATrainer`` under ``trainer.v1.trainer_mode=populora`` (idempotent); returns the class."""
    # Import verl first: its __init__ loads this plugin (entry point or VERL_USE_EXTERNAL_MODULES), which calls
    # back into register(); importing trainer.trainer before verl would make that a circular import.
    import verl  # noqa: F401

    from populora_verl.trainer.trainer import register as _register

    return _register()
