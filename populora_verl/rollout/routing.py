"""Per-request adapter routing on the vLLM server side, free of vLLM imports (so it is testable on CPU).

:class:`PopuLoRAServerMixin` holds everything ``PopuLoRAvLLMHttpServer`` adds to verl's ``vLLMHttpServer``; it is
mixed in front of the real server class in :mod:`populora_verl.rollout.vllm_server` and in front of a fake one in the
CPU tests. Where the installed verl has the vLLM-side patches of the series (:mod:`populora_verl.verl_compat`), it
uses verl's public API; on verl 0.9.1 it relies on the server attributes ``engine`` (vLLM ``AsyncLLM``),
``run_server``, ``run_headless`` and ``_preprocess_engine_kwargs`` (guarded by the signature-drift test):

* ``max_loras``: verl passes ``rollout.engine_kwargs.vllm.max_loras`` (0001), else ``_preprocess_engine_kwargs``
  and ``run_server``/``run_headless`` put it back after verl forced 1;
* the request's adapter: ``generate(lora=...)`` (0002), else ``self.engine`` is wrapped (:class:`LoraRoutingEngine`);
* weight sync: verl's worker extension loads the adapter under the caller's id (0003) and this server retires old
  ids through vLLM's ``remove_lora``, else the plugin's worker extension does both
  (:mod:`populora_verl.rollout.vllm_extension`).

Either way the live-adapter registry is kept here, from the weight-sync RPCs, and consulted before every request.
"""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Mapping
from typing import Any, Callable

from populora_verl import verl_compat
from populora_verl.rollout.lora_registry import (
    LiveLoraRegistry,
    LoraCapacity,
    PopuLoRARoutingError,
    adapter_sync_target,
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

    # --- launch: the adapter capacity ------------------------------------------------------------------------

    def _populora_set_capacity(self, engine_kwargs: Mapping[str, Any]) -> None:
        self._populora_capacity = LoraCapacity.from_engine_kwargs(engine_kwargs)
        self._populora_registry = LiveLoraRegistry(self._populora_capacity)

    if verl_compat.max_loras_from_engine_kwargs():
        # verl hands rollout.engine_kwargs.vllm.{max_loras, max_cpu_loras} to vLLM itself: the registry is sized
        # from the same keys, read as verl reads them (unset values dropped), before verl starts the engine.
        async def launch_server(self, *args: Any, **kwargs: Any) -> Any:
            engine_kwargs = (self.config.get("engine_kwargs", {}) or {}).get("vllm", {}) or {}
            self._populora_set_capacity({k: v for k, v in engine_kwargs.items() if v is not None})
            return await super().launch_server(*args, **kwargs)

    else:
        # verl 0.9.1 forces max_loras=1 after this hook: read the configured values here, put them back in
        # run_server / run_headless (the last hooks before vLLM reads them).
        def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
            verl_compat.private_path("_preprocess_engine_kwargs")
            super()._preprocess_engine_kwargs(engine_kwargs)
            self._populora_set_capacity(engine_kwargs)

    def _apply_lora_capacity(self, args: Any) -> None:
        if verl_compat.max_loras_from_engine_kwargs():
            return  # verl passed the configured values
        if self._populora_capacity is None:
            raise RuntimeError("populora_vllm: LoRA capacity unknown (launch_server did not run)")
        args.max_loras = self._populora_capacity.max_loras
        args.max_cpu_loras = self._populora_capacity.max_cpu_loras

    async def run_server(self, args: Any) -> None:
        self._apply_lora_capacity(args)
        await super().run_server(args)
        if not verl_compat.has_per_request_lora():
            # verl 0.9.1's generate always sends its fixed adapter id: substitute the request's in the engine.
            verl_compat.private_path("populora_verl.rollout.routing")
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
            if verl_compat.has_per_id_weight_sync():
                # verl's extension takes one adapter per transfer; the worker sends one transfer per adapter there
                raise ValueError("lora_targets needs the PopuLoRA worker extension (verl without per-id weight sync)")
            return await self._populora_update_several(method, timeout, args, kwargs)
        if method != "update_weights_from_ipc":
            return await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        if lora_id is None:
            if verl_compat.has_per_id_weight_sync():  # verl's extension would take it (the plugin's refuses it)
                adapter_sync_target(kwargs.get("peft_config"), kwargs.get("base_sync_done"), None, None)
            return await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        registry = self._registry()
        retire = tuple(kwargs.get("retire_lora_int_ids") or ())
        registry.begin_update(int(lora_id), str(kwargs.get("lora_name")), retire)
        try:
            if verl_compat.has_per_id_weight_sync():
                kwargs = await self._populora_verl_adapter_sync(kwargs, retire)
            result = await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        except BaseException:
            registry.abort_update(int(lora_id))
            raise
        registry.commit_update(int(lora_id))
        return result

    async def _populora_verl_adapter_sync(self, kwargs: dict[str, Any], retire: tuple) -> dict[str, Any]:
        """verl's extension (re)loads the adapter under the caller's id and name: check them as the plugin's extension
        did, free the retired versions' cache room first (vLLM's worker ``remove_lora``), and pass verl only the
        keys it takes."""
        lora_id, name = adapter_sync_target(
            kwargs.get("peft_config"), kwargs.get("base_sync_done"), kwargs["lora_int_id"], kwargs.get("lora_name")
        )
        await self._populora_remove(retire)
        kwargs.pop("retire_lora_int_ids", None)
        return {**kwargs, "lora_int_id": lora_id, "lora_name": name}

    async def _populora_remove(self, lora_int_ids: Any) -> None:
        """Drop adapters from every vLLM worker's cache, one ``remove_lora`` RPC each (vLLM's worker method; an id
        that is not cached is a no-op there)."""
        for lid in lora_int_ids:
            await super().collective_rpc("remove_lora", args=(int(lid),))

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
        if verl_compat.has_per_id_weight_sync():
            await self._populora_remove(ids)  # the plugin's worker extension is not loaded
        else:
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

    async def _populora_resolve(self, spec: Any) -> tuple[int, str]:
        """The live ``(lora_int_id, lora_name)`` a request's adapter field names; raises for an adapter that is
        missing, unknown, retired or evicted from vLLM's cache."""
        spec = lora_spec_from_prompt(spec)
        registry = self._registry()
        lora_id, name = registry.resolve(spec["lora_int_id"], spec["lora_name"])
        registry.check_loaded(lora_id, await self.engine.list_loras())
        return lora_id, name

    async def _populora_lora_request(self, populora_lora: Any) -> Any:
        return self._make_lora_request(*await self._populora_resolve(populora_lora))

    async def generate(
        self,
        prompt_ids,
        sampling_params,
        request_id,
        *args: Any,
        populora_lora: Any = None,
        lora: Any = None,
        **kwargs: Any,
    ):
        """verl's ``generate`` served by the request's adapter, ``{"lora_int_id", "lora_name"?}``: ``lora`` is the
        field verl's agent loop forwards (0002), ``populora_lora`` the plugin's own callers' (the probes)."""
        if lora is not None and populora_lora is not None and lora != populora_lora:
            raise PopuLoRARoutingError(f"conflicting adapters {lora} and {populora_lora} for request {request_id}")
        spec = populora_lora if populora_lora is not None else lora
        if verl_compat.has_per_request_lora():
            # verl builds the LoRARequest and refuses an id vLLM does not hold; the registry checked it is live
            lora_id, name = await self._populora_resolve(spec)
            kwargs["lora"] = {"lora_int_id": lora_id, "lora_name": name}
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        verl_compat.private_path("populora_verl.rollout.routing")
        request = await self._populora_lora_request(spec)
        token = _REQUEST_LORA.set(request)
        try:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            _REQUEST_LORA.reset(token)
