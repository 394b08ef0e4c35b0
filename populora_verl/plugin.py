"""verl plugin entry point (``verl.plugins: populora = populora_verl.plugin``).

verl imports this module in every process at ``import verl`` and swallows import errors at DEBUG level, so:
everything registers by side effect at import time, nothing here imports vLLM (the rollout backend is
registered through a lazy loader), and :func:`check_registrations` lets the trainer fail at start-up with one
clear line if a registration is missing.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: What this plugin registers with verl: (registry, name). Checked by :func:`check_registrations`.
EXPECTED: list[tuple[str, str]] = [
    ("adv_estimator", "populora_trrpp"),
]

_errors: dict[str, str] = {}


def _register_advantage() -> None:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    if "populora_trrpp" in ADV_ESTIMATOR_REGISTRY:
        return
    from populora_verl.advantage import trrpp_advantages

    @register_adv_est("populora_trrpp")
    def compute_populora_trrpp_advantage(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        """TRR++: ``index`` carries each sample's (adapter, task, role) group key."""
        if index is None:
            raise ValueError("populora_trrpp needs the per-sample group index (adapter, task, role)")
        gamma = getattr(config, "gamma", 1.0) if config is not None else 1.0
        return trrpp_advantages(token_level_rewards, response_mask, list(index), gamma=gamma)


def _run(name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # keep going: check_registrations() reports the failure with its cause
        _errors[name] = f"{type(e).__name__}: {e}"
        logger.warning("populora plugin: registering %s failed: %s", name, _errors[name])


_run("adv_estimator", _register_advantage)


def registered() -> dict[str, bool]:
    """Which of :data:`EXPECTED` are present in verl's registries right now."""
    out: dict[str, bool] = {}
    for registry, name in EXPECTED:
        if registry == "adv_estimator":
            from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

            out[f"{registry}:{name}"] = name in ADV_ESTIMATOR_REGISTRY
    return out


def check_registrations() -> None:
    """Raise ``RuntimeError`` (one line) if any PopuLoRA registration is missing from verl."""
    missing = [k for k, ok in registered().items() if not ok]
    if missing:
        causes = "; ".join(f"{k}: {v}" for k, v in _errors.items())
        raise RuntimeError(f"populora_verl plugin not fully registered with verl: missing {missing}"
                           + (f" ({causes})" if causes else "") + " — is `pip install -e .` done in this environment?")
