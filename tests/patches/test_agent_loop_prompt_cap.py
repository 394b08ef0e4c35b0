"""0013: the agent loop's prompt-length cap is public (the plugin's agent loop tokenizes plain-text prompts itself and
calls the private ``_cap_text_prompt_length`` on them, to cap them as verl caps a chat prompt)."""

from __future__ import annotations

PATCH = "0013-agent-loop-public-prompt-cap.patch"

# verl's own agent-loop methods on CPU: a loop built without __init__, with the rollout config's prompt length and a
# stand-in continuous-token builder (the ids a chat template would render).
CHECK = """
import asyncio, logging, types
from verl.experimental.agent_loop import agent_loop
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

warnings_seen = []

class Recorder(logging.Handler):
    def emit(self, record):
        warnings_seen.append(record.getMessage())

agent_loop.logger.addHandler(Recorder(level=logging.WARNING))

class Builder:
    def build_initial_tokens(self, messages, **kwargs):
        return list(range(12))

class NeverTruncates(SingleTurnAgentLoop):
    def cap_text_prompt_length(self, prompt_ids):
        if len(prompt_ids) > self.rollout_config.prompt_length:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens")
        return prompt_ids

def build(cls, prompt_length):
    loop = cls.__new__(cls)
    loop.loop = asyncio.get_running_loop()
    loop.rollout_config = types.SimpleNamespace(prompt_length=prompt_length)
    loop.continuous_token_builder = Builder()
    return loop

async def main():
    loop = build(SingleTurnAgentLoop, 8)
    # the public cap: a prompt the loop tokenized itself is left-truncated with a warning, a short one kept as is
    assert loop.cap_text_prompt_length(list(range(12))) == list(range(4, 12))
    assert len(warnings_seen) == 1 and "rollout.prompt_length=8" in warnings_seen[0], warnings_seen
    assert loop.cap_text_prompt_length([1, 2, 3]) == [1, 2, 3] and len(warnings_seen) == 1
    # verl's own prompt path caps through it ...
    assert await loop.ct_build_initial_tokens([{"role": "user", "content": "x"}]) == list(range(4, 12))
    # ... so a loop that must never truncate replaces it there too
    try:
        await build(NeverTruncates, 8).ct_build_initial_tokens([{"role": "user", "content": "x"}])
    except ValueError as e:
        assert "12 tokens" in str(e), e
    else:
        raise AssertionError("verl's prompt path did not use the loop's own cap")
    assert await build(NeverTruncates, 16).ct_build_initial_tokens([]) == list(range(12))
    assert len(warnings_seen) == 2, warnings_seen  # verl's cap warned once more, the loop's own never

asyncio.run(main())
print("ok")
"""


def test_the_prompt_length_cap_is_public_and_used_by_verls_prompt_path(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(
        PATCH, CHECK, expect_without="has no attribute 'cap_text_prompt_length'"
    )
