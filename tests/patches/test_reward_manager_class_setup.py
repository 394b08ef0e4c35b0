"""0016: ``RewardManagerBase.setup_class`` / ``reset_class``, one-time class setup for a reward manager without the
private ``_class_initialized`` flag (the plugin's reward manager reads and writes it)."""

from __future__ import annotations

PATCH = "0016-reward-manager-class-setup.patch"

# verl's own RewardManagerBase.__init__ / init_class, with subclasses that record their setup.
CHECK = """
from omegaconf import OmegaConf
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

calls = []

class Shared(RewardManagerBase):
    fail = False

    @classmethod
    def setup_class(cls, config, tokenizer):
        calls.append((cls.__name__, config.get("tag")))
        if cls.fail:
            raise RuntimeError("setup failed")
        cls.client = f"client for {config.get('tag')}"

    async def run_single(self, data):
        return {}

class Derived(Shared):
    pass

a = OmegaConf.create({"tag": "a"})
Shared(a, None, None)
Shared(OmegaConf.create({"tag": "ignored"}), None, None)
assert calls == [("Shared", "a")], f"setup ran {calls} for two instances of one class"
Derived(a, None, None)  # a subclass of a set-up class still gets its own setup
assert calls == [("Shared", "a"), ("Derived", "a")], calls
Shared.reset_class()  # a new config in the same process
Shared(OmegaConf.create({"tag": "b"}), None, None)
assert calls[-1] == ("Shared", "b") and Shared.client == "client for b", calls
Derived(a, None, None)
assert len(calls) == 3, calls  # Derived was not reset

Shared.reset_class()
Shared.fail = True
for _ in range(2):  # a failed setup is not marked done: the next instance tries again
    try:
        Shared(a, None, None)
    except RuntimeError:
        pass
assert calls[-2:] == [("Shared", "a"), ("Shared", "a")], calls

NaiveRewardManager(a, None, None)  # verl's own managers are unchanged
print("ok")
"""


def test_class_setup_runs_once_per_class_and_again_after_reset(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="for two instances of one class")
