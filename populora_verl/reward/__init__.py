"""Rewards: the verl reward manager ``populora_code`` (per trajectory, :mod:`.manager`) and the driver-side
reward levels (:mod:`.levels`).

``populora_verl.reward.manager`` imports verl, so it is loaded lazily: ``from populora_verl.reward import
register`` (or ``PopuLoRACodeRewardManager``) triggers it, ``import populora_verl.reward`` does not.
"""

from populora_verl.reward.levels import learnability, solve_rate, student_reward, teacher_reward

__all__ = ["learnability", "solve_rate", "student_reward", "teacher_reward", "register", "PopuLoRACodeRewardManager"]


def __getattr__(name: str):
    if name in ("register", "PopuLoRACodeRewardManager"):
        from populora_verl.reward import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
