"""``populora_agent``: verl's single-turn agent loop, with each prompt's adapter passed to the rollout server.

Every prompt field reaches ``AgentLoopBase.run(**kwargs)``; ours is ``populora`` (a dict with ``lora_int_id`` and
optionally ``lora_name``, ``slot``, ``role``, ``task``). Where verl's single-turn loop forwards a prompt field ``lora``
to the server's ``generate`` (the series' per-request adapter), the loop hands it ``lora={lora_int_id, lora_name}``;
on verl 0.9.1, which forwards no prompt field, it wraps the server client (:class:`LoraInjectingClient`), whose
``generate`` adds ``populora_lora={lora_int_id, lora_name}``. ``LLMServerClient.generate`` forwards either to
``PopuLoRAvLLMHttpServer.generate``. A prompt without a usable ``populora`` field fails before any token is generated.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from populora_verl import verl_compat
from populora_verl.rollout.lora_registry import POPULORA_FIELD, lora_spec_from_prompt

__all__ = ["PopuLoRAAgentLoop", "AGENT_NAME", "LoraInjectingClient"]

AGENT_NAME = "populora_agent"

_PROMPT_LORA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "populora_prompt_lora", default=None
)
# The current prompt when it is plain text (populora.prompt_format="text"): tokenized as is, no chat template.
_PROMPT_TEXT: contextvars.ContextVar[str | None] = contextvars.ContextVar("populora_prompt_text", default=None)


def raw_text_prompt(populora: Any, raw_prompt: Any) -> str | None:
    """The plain-text prompt of a row whose ``populora.prompt_format`` is ``text`` (one user message), else None."""
    if not isinstance(populora, Mapping) or populora.get("prompt_format") != "text":
        return None
    msgs = list(raw_prompt)
    if len(msgs) != 1 or not isinstance(msgs[0], Mapping) or not isinstance(msgs[0].get("content"), str):
        raise ValueError("populora_agent: a prompt_format=text row needs raw_prompt = one message with string content")
    return msgs[0]["content"]


_STOP_CACHE: dict[str, list[int]] = {}


def _stop_ids(tokenizer: Any, config: Any) -> list[int]:
    """Stop ids for the run's model, read once per process (every agent-loop worker builds many loops)."""
    from omegaconf import OmegaConf

    from populora_verl.stop_tokens import load_generation_config, stop_token_ids

    path = OmegaConf.select(config, "actor_rollout_ref.model.path", default=None) if config is not None else None
    key = f"{path}|{getattr(tokenizer, 'name_or_path', '')}"
    if key not in _STOP_CACHE:
        _STOP_CACHE[key] = stop_token_ids(tokenizer, load_generation_config(path))
    return _STOP_CACHE[key]


def _ignores_eos(config: Any, sampling_params: Mapping[str, Any]) -> bool:
    """``ignore_eos`` asks for answers that run to the length cap (e.g. step_scaling's forced lengths); vLLM still
    stops on ``stop_token_ids``, so the extra stop ids must not be added then."""
    if "ignore_eos" in sampling_params:
        return bool(sampling_params["ignore_eos"])
    if config is None:
        return False
    from omegaconf import OmegaConf

    return bool(OmegaConf.select(config, "actor_rollout_ref.rollout.ignore_eos", default=False))


def _forwards_lora_field() -> bool:
    """Whether verl's single-turn loop passes the prompt field ``lora`` to the server and verl's vLLM server serves
    it (both halves of the series' per-request adapter)."""
    return verl_compat.has_agent_loop_lora_field() and verl_compat.has_per_request_lora()


class LoraInjectingClient:
    """Wraps an ``LLMServerClient``: ``generate`` adds the current prompt's ``populora_lora``; all else delegates."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        spec = _PROMPT_LORA.get()
        if spec is None:
            raise RuntimeError("populora_agent: generate called outside PopuLoRAAgentLoop.run (no adapter known)")
        if "populora_lora" in kwargs and kwargs["populora_lora"] != spec:
            raise RuntimeError(f"populora_agent: conflicting adapters {kwargs['populora_lora']} and {spec}")
        kwargs["populora_lora"] = spec
        return await self._client.generate(*args, **kwargs)


class PopuLoRAAgentLoop(SingleTurnAgentLoop):
    """Single-turn generation served by the adapter named in the prompt's ``populora`` field."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not _forwards_lora_field() and not isinstance(self.server_manager, LoraInjectingClient):
            verl_compat.private_path("populora_verl.rollout.agent_loop")
            self.server_manager = LoraInjectingClient(self.server_manager)
        self.stop_ids = _stop_ids(self.tokenizer, self.config)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        spec = lora_spec_from_prompt(kwargs.get(POPULORA_FIELD))
        stops = getattr(self, "stop_ids", None)
        if stops is None and getattr(self, "tokenizer", None) is not None:
            stops = self.stop_ids = _stop_ids(self.tokenizer, getattr(self, "config", None))
        if stops and not _ignores_eos(getattr(self, "config", None), sampling_params):
            # the model's chat end token as well as the tokenizer's EOS (populora_verl.stop_tokens)
            given = list(sampling_params.get("stop_token_ids") or [])
            sampling_params = {**sampling_params, "stop_token_ids": given + [i for i in stops if i not in given]}
        text = raw_text_prompt(kwargs.get(POPULORA_FIELD), kwargs.get("raw_prompt", ()))
        if _forwards_lora_field():
            # verl's loop hands the prompt field "lora" to the server's generate(lora=...)
            if kwargs.get("lora") is not None and dict(kwargs["lora"]) != spec:
                raise RuntimeError(f"populora_agent: conflicting adapters {kwargs['lora']} and {spec}")
            kwargs = {**kwargs, "lora": spec}
        token, text_token = _PROMPT_LORA.set(spec), _PROMPT_TEXT.set(text)
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            _PROMPT_LORA.reset(token)
            _PROMPT_TEXT.reset(text_token)
        # Keep the serving id next to the trajectory so the trainer can check rollout/trainer adapter agreement.
        output.extra_fields["populora_lora_int_id"] = spec["lora_int_id"]
        return output

    async def ct_build_initial_tokens(self, messages: list[dict], *args: Any, **kwargs: Any) -> list[int]:
        """A plain-text prompt is tokenized by :func:`~populora_verl.tasks.prompts.encode_prompt` (the CPU driver's
        tokenization, no chat template); chat prompts keep verl's continuous-token builder."""
        text = _PROMPT_TEXT.get()
        if text is None:
            return await super().ct_build_initial_tokens(messages, *args, **kwargs)
        from populora_verl.tasks.prompts import encode_prompt

        ids = await self.loop.run_in_executor(None, encode_prompt, self.tokenizer, text)
        # capped to rollout.prompt_length as verl caps a chat prompt: by its public name where verl has one
        if verl_compat.has_public_prompt_cap():
            return self.cap_text_prompt_length(ids)
        verl_compat.private_path("_cap_text_prompt_length")
        return self._cap_text_prompt_length(ids)
