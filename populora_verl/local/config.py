"""Driver-only options of the CPU driver (``local.*``), validated like the ``populora.*`` schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from populora_verl.config import ConfigError, _build, _check, _choice

__all__ = ["LocalConfig", "load_local_config", "TINY_POPULORA_DEFAULTS", "TINY_LOCAL_DEFAULTS"]

LOCAL = "local"

# ``populora.*`` values the embedded tiny default runs with (a few steps on 2 cores with one evolution event).
TINY_POPULORA_DEFAULTS: dict[str, Any] = {
    "population": {"num_teachers": 2, "num_students": 2},
    # teacher_n=2: a TRR++ group of one sample has advantage 0, so one proposal per (teacher, type) would never train.
    "rollout": {"teacher_n": 2, "student_n": 2, "proposals_per_type": 1, "max_new_tokens": 32},
    "tasks": {"num_references": 2, "num_inputs": 4},
    "executor": {"timeout_s": 5.0, "max_workers": 2},
    # final_quiet_steps=1: the 3-step demo evolves after step 2 and trains the children once in step 3.
    "pbt": {"interval_steps": 2, "final_quiet_steps": 1},
    "diagnostics": {"cvt_cells": 16, "cvt_samples": 2000},
}

# ``local.*`` values of the embedded tiny default: a random model gains nothing from a 1000-token prompt, so keep its
# last 256 tokens (the question and the answer format) and train fast.
TINY_LOCAL_DEFAULTS: dict[str, Any] = {"max_prompt_tokens": 256}


@dataclass
class LocalConfig:
    """Options of ``python -m populora_verl.local`` that the verl recipes do not have."""

    steps: int = 3  # with pbt.interval_steps=2: one evolution event (after step 2), then a step with the children
    lr: float = 1e-3  # LoRA on a tiny random model; real models want ~1e-5..1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0  # <= 0 disables clipping
    micro_batch_size: int = 8  # sequences per forward/backward in an update
    gen_batch_size: int = 32  # sequences per generate call (mixed adapters)
    max_prompt_tokens: int = 1536  # longer prompts keep their last tokens
    top_p: float = 1.0
    lora_r: int = 8
    lora_alpha: int = 16
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    save_every: int = 1  # checkpoint every N steps (and at the end); 0: only at the end
    # Complete checkpoints kept on disk; older ones are deleted after each save. 2 keeps what resume and evaluation
    # read (the newest) plus the one resume falls back to when the newest is damaged. 0 keeps all.
    keep_checkpoints: int = 2
    dtype: str = "float32"
    tensorboard: bool = True
    progress: bool = True
    _prefix: str = field(default=LOCAL, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        for k in ("steps", "micro_batch_size", "gen_batch_size", "max_prompt_tokens", "lora_r", "lora_alpha"):
            v = getattr(self, k)
            _check(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                f"{p}.{k}",
                f"must be an integer >= 1, got {v!r}",
            )
        _check(self.lr > 0, f"{p}.lr", f"must be > 0, got {self.lr!r}")
        _check(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{p}.betas",
            f"must be two numbers in [0, 1), got {self.betas!r}",
        )
        _check(0 < self.top_p <= 1, f"{p}.top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(len(self.lora_target_modules) >= 1, f"{p}.lora_target_modules", "must name at least one module")
        _check(isinstance(self.save_every, int) and self.save_every >= 0, f"{p}.save_every", "must be an integer >= 0")
        _check(
            isinstance(self.keep_checkpoints, int)
            and not isinstance(self.keep_checkpoints, bool)
            and self.keep_checkpoints >= 0,
            f"{p}.keep_checkpoints",
            f"must be an integer >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints!r}",
        )
        _choice(self.dtype, ("float32", "bfloat16", "float16"), f"{p}.dtype")


def load_local_config(data: Mapping[str, Any] | None = None) -> LocalConfig:
    """Build a :class:`LocalConfig` from a mapping; unknown keys and bad values raise :class:`ConfigError`."""
    out = _build(LocalConfig, data, LOCAL)
    if not isinstance(out, LocalConfig):  # pragma: no cover - _build always returns the class
        raise ConfigError(f"{LOCAL}: could not build")
    return out
