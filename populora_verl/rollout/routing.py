"""Per-request adapter routing on the vLLM server side, free of vLLM imports (so it is testable on CPU).

:class:`PopuLoRAServerMixin` holds everything ``PopuLoRAvLLMHttpServer`` adds to verl's ``vLLMHttpServer``; it is
mixed in front of the real server class in :mod:`populora_verl.rollout.vllm_server` and in front of a fake one in the
CPU tests. It relies only on the server attributes ``engine`` (vLLM ``AsyncLLM``), ``collective_rpc``, ``generate``,
``run_server``, ``run_headless`` and ``_preprocess_engine_kwargs`` of verl 0.9.1 (guarded by the signature-drift test).
"""

from __future__ import annotations

import contextvars
import copy
from typing import Any, Callable

from populora_verl.rollout.lora_registry import (
    LiveLoraRegistry,
    LoraCapacity,
    PopuLoRARoutingError,
    lora_spec_from_prompt,
    lora_targets,
)

__all__ = ["LoraRoutingEngine", "PopuLoRAServerMixin", "current_lora_request"]

# Set by PopuLoRAServerMixin.generate for the duration of one request. Ray runs every call of an async actor in its
# own asyncio task, and each task runs in a copy of the context, so concurrent requests never see each other's value.
_REQUEST_LORA: contextvars.ContextVar[Any | None] = contextvars.ContextVar("populora_request_lora", default=None)


def current_lora_request() -> Any | None:
    return _REQUEST_LORA.get()


class LoraRoutingEngine:
    """Delegates to vLLM's ``AsyncLLM``; ``generate`` serves the adapter of the current request's context.

    verl's ``generate`` builds ``lora_request`` itself (id 123, or ``None`` if 123 is not loaded); whatever it passes is
    replaced, and a call outside a PopuLoRA request raises instead of running on the base model.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, lora_request: Any = None, **kwargs: Any):
        request = _REQUEST_LORA.get()
        if request is None:
            raise PopuLoRARoutingError(
                "vLLM generate called without a PopuLoRA adapter (requests must go through "
                "PopuLoRAvLLMHttpServer.generate with populora_lora)"
            )
        return self._engine.generate(*args, lora_request=request, **kwargs)


class PopuLoRAServerMixin:
    """Multi-LoRA serving on top of a verl ``vLLMHttpServer`` (see :mod:`populora_verl.rollout.vllm_server`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._populora_capacity: LoraCapacity | None = None
        self._populora_registry: LiveLoraRegistry | None = None

    def _make_lora_request(self, lora_id: int, name: str) -> Any:
        # The concrete server builds vLLM's LoRARequest; the mixin stays importable without vLLM (tests use fakes).
        raise TypeError(f"{type(self).__name__} must define _make_lora_request (PopuLoRAvLLMHttpServer does)")

    # --- launch: undo verl's max_loras=1 ---------------------------------------------------------------------

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        self._populora_capacity = LoraCapacity.from_engine_kwargs(engine_kwargs)
        self._populora_registry = LiveLoraRegistry(self._populora_capacity)

    def _apply_lora_capacity(self, args: Any) -> None:
        if self._populora_capacity is None:
            raise RuntimeError("populora_vllm: LoRA capacity unknown (launch_server did not run)")
        args.max_loras = self._populora_capacity.max_loras
        args.max_cpu_loras = self._populora_capacity.max_cpu_loras

    async def run_server(self, args: Any) -> None:
        self._apply_lora_capacity(args)
        await super().run_server(args)
        self.engine = LoraRoutingEngine(self.engine)

    async def run_headless(self, args: Any) -> None:
        self._apply_lora_capacity(args)
        await super().run_headless(args)

    # --- weight sync: keep the live-adapter registry ---------------------------------------------------------

    async def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ):
        kwargs = dict(kwargs or {})
        lora_id = kwargs.get("lora_int_id")
        if method == "update_weights_from_ipc" and kwargs.get("lora_targets") is not None:
            return await self._populora_update_several(method, timeout, args, kwargs)
        if method != "update_weights_from_ipc" or lora_id is None:
            return await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        registry = self._registry()
        registry.begin_update(int(lora_id), str(kwargs.get("lora_name")), kwargs.get("retire_lora_int_ids") or ())
        try:
            result = await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        except BaseException:
            registry.abort_update(int(lora_id))
            raise
        registry.commit_update(int(lora_id))
        return result

    async def _populora_update_several(
        self, method: str, timeout: float | None, args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        """Several adapters in one weight transfer: every id out of service until all of them have arrived."""
        registry = self._registry()
        targets = lora_targets(kwargs["lora_targets"])
        probe = copy.deepcopy(registry)  # a transfer the registry refuses never starts and changes nothing
        for t in targets:
            probe.begin_update(t.lora_int_id, t.lora_name, t.retire)
        begun: list[int] = []
        try:
            for t in targets:
                registry.begin_update(t.lora_int_id, t.lora_name, t.retire)
                begun.append(t.lora_int_id)
            kwargs["lora_targets"] = [t.as_dict() for t in targets]
            result = await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        except BaseException:
            for lid in begun:
                registry.abort_update(lid)
            raise
        for lid in begun:
            registry.commit_update(lid)
        return result

    async def populora_retire_loras(self, lora_int_ids: list[int]) -> None:
        """Take ids out of service and out of vLLM's cache (e.g. slots removed from the population)."""
        ids = [int(i) for i in lora_int_ids]
        self._registry().retire(ids)
        await super().collective_rpc("populora_remove_loras", kwargs={"lora_int_ids": ids})

    async def populora_live_loras(self) -> dict[str, Any]:
        """Registry state plus the ids vLLM actually holds (start-up checks, debugging)."""
        state = self._registry().state()
        engine = getattr(self, "engine", None)
        state["loaded"] = sorted(await engine.list_loras()) if engine is not None else []
        return state

    def _registry(self) -> LiveLoraRegistry:
        if self._populora_registry is None:
            raise RuntimeError("populora_vllm: server not launched yet")
        return self._populora_registry

    # --- generation ------------------------------------------------------------------------------------------

    async def _populora_lora_request(self, populora_lora: Any) -> Any:
        spec = lora_spec_from_prompt(populora_lora)
        registry = self._registry()
        lora_id, name = registry.resolve(spec["lora_int_id"], spec["lora_name"])
        registry.check_loaded(lora_id, await self.engine.list_loras())
        return self._make_lora_request(lora_id, name)

    async def generate(
        self, prompt_ids, sampling_params, request_id, *args: Any, populora_lora: Any = None, **kwargs: Any
    ):
        """verl's ``generate`` served by the request's adapter; ``populora_lora = {"lora_int_id", "lora_name"?}``."""
        request = await self._populora_lora_request(populora_lora)
        token = _REQUEST_LORA.set(request)
        try:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            _REQUEST_LORA.reset(token)
