"""populora_vllm routing on CPU: id scheme, live-adapter registry, server mixin over a fake server, agent loop.

The fake server behaves as the installed verl's ``vLLMHttpServer`` would: verl 0.9.1's (``max_loras`` forced to 1,
the fixed adapter id 123) or, where verl has the vLLM-side patches of the series (tests/patches runs these tests
against such a copy), the patched one (``max_loras`` from the engine kwargs, ``generate(lora=...)``, the adapter
loaded under the caller's id). The plugin takes the matching path (populora_verl.verl_compat)."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from populora_verl.rollout.lora_registry import (
    LORA_ID_BASE,
    EvictedLoraError,
    LiveLoraRegistry,
    LoraCapacity,
    LoraCapacityError,
    LoraMismatchError,
    PopuLoRARoutingError,
    StaleLoraError,
    UnknownLoraError,
    decode_lora_int_id,
    lora_int_id,
    lora_name,
    lora_targets,
    split_adapter_tensors,
    tag_adapter_tensors,
    lora_spec_from_prompt,
    parse_lora_name,
    adapter_sync_target,
)
from populora_verl import verl_compat
from populora_verl.rollout.routing import LoraRoutingEngine, PopuLoRAServerMixin, current_lora_request

PER_REQUEST = verl_compat.has_per_request_lora()
PER_ID_SYNC = verl_compat.has_per_id_weight_sync()
MAX_LORAS = verl_compat.max_loras_from_engine_kwargs()
PEFT = {"r": 8, "lora_alpha": 16}  # an adapter sync carries the adapter's PEFT config

# --- id scheme ----------------------------------------------------------------------------------------------


@given(st.integers(1, 64), st.data())
def test_lora_id_is_a_bijection_on_slot_version(num_slots, data):
    pairs = data.draw(st.lists(st.tuples(st.integers(0, num_slots - 1), st.integers(0, 10_000)), min_size=2, max_size=20))
    ids = {p: lora_int_id(*p, num_slots) for p in pairs}
    assert len(set(ids.values())) == len(set(pairs))
    for (s, v), lid in ids.items():
        assert lid >= LORA_ID_BASE and lid != 123
        assert decode_lora_int_id(lid, num_slots) == (s, v)
        assert parse_lora_name(lora_name(s, v)) == (s, v)


def test_lora_id_rejects_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        lora_int_id(4, 0, 4)
    with pytest.raises(ValueError):
        lora_int_id(-1, 0, 4)
    with pytest.raises(ValueError):
        decode_lora_int_id(123, 4)
    with pytest.raises(ValueError):
        parse_lora_name("default")


def test_lora_spec_from_prompt():
    assert lora_spec_from_prompt({"lora_int_id": 1001, "slot": 1, "role": "teacher"}) == {"lora_int_id": 1001, "lora_name": None}
    import numpy as np

    assert lora_spec_from_prompt({"lora_int_id": np.int64(1002), "lora_name": "2@v0"})["lora_int_id"] == 1002
    for bad, msg in ((None, "no 'populora'"), ("x", "mapping"), ({"slot": 1}, "lora_int_id"), ({"lora_int_id": "7"}, "integer")):
        with pytest.raises(PopuLoRARoutingError, match=msg):
            lora_spec_from_prompt(bad)


def test_adapter_sync_target():
    """What a weight-sync call loads its adapter under, as both the server and the plugin's worker extension check it."""
    lid = lora_int_id(1, 2, 4)
    assert adapter_sync_target(PEFT, True, lid, lora_name(1, 2)) == (lid, "1@v2")
    assert adapter_sync_target(None, False, None, None) is None  # base weights: no adapter, verl's path
    assert adapter_sync_target(PEFT, False, None, None) is None  # the base not synced yet: not an adapter sync
    for args, msg in (((PEFT, True, None, None), "needs lora_int_id"),  # verl would load it under id 123
                      ((None, False, lid, "1@v2"), "only meaningful"),
                      ((PEFT, True, LORA_ID_BASE - 1, "1@v2"), "not a PopuLoRA id"),
                      ((PEFT, True, lid, "default"), "not a PopuLoRA lora_name")):
        with pytest.raises(ValueError, match=msg):
            adapter_sync_target(*args)


# --- live registry ------------------------------------------------------------------------------------------


def push(reg: LiveLoraRegistry, slot: int, version: int, n: int = 4, retire=()):
    lid = lora_int_id(slot, version, n)
    reg.begin_update(lid, lora_name(slot, version), retire)
    reg.commit_update(lid)
    return lid


def test_registry_serves_live_and_rejects_stale_unknown_mismatch():
    reg = LiveLoraRegistry(LoraCapacity(max_loras=4, max_cpu_loras=4))
    ids = [push(reg, s, 0) for s in range(4)]
    assert reg.resolve(ids[2]) == (ids[2], "2@v0")
    assert reg.resolve(ids[2], "2@v0") == (ids[2], "2@v0")
    # A training-step resync of the same id is allowed (same name), and leaves it live.
    push(reg, 2, 0)
    # Evolution replaces slot 2: new id, the old one retired in the same update.
    new = push(reg, 2, 1, retire=[ids[2]])
    assert reg.resolve(new) == (new, "2@v1")
    with pytest.raises(StaleLoraError, match="retired"):
        reg.resolve(ids[2])
    with pytest.raises(StaleLoraError):
        reg.begin_update(ids[2], "2@v0")  # ids are never reused
    with pytest.raises(UnknownLoraError, match="never pushed"):
        reg.resolve(lora_int_id(3, 5, 4))
    with pytest.raises(LoraMismatchError, match="serves 1@v0"):
        reg.resolve(ids[1], "3@v0")
    assert sorted(reg.live) == sorted([ids[0], ids[1], new, ids[3]])


def test_registry_one_live_id_per_slot_and_capacity():
    reg = LiveLoraRegistry(LoraCapacity(max_loras=2, max_cpu_loras=3))
    old = push(reg, 0, 0)
    with pytest.raises(LoraMismatchError, match="two live adapters"):
        reg.begin_update(lora_int_id(0, 1, 4), "0@v1")  # forgot to retire v0
    push(reg, 1, 0)
    push(reg, 2, 0)
    with pytest.raises(LoraCapacityError, match="max_cpu_loras=3"):
        reg.begin_update(lora_int_id(3, 0, 4), "3@v0")
    push(reg, 0, 1, retire=[old])  # replacing within capacity is fine
    with pytest.raises(ValueError):
        LoraCapacity(max_loras=4, max_cpu_loras=2)


def test_registry_failed_update_takes_id_out_of_service():
    reg = LiveLoraRegistry(LoraCapacity(4, 8))
    lid = push(reg, 0, 0)
    reg.begin_update(lid, "0@v0")
    with pytest.raises(UnknownLoraError, match="being updated"):
        reg.resolve(lid)
    reg.abort_update(lid)
    with pytest.raises(UnknownLoraError):
        reg.resolve(lid)


def test_registry_detects_eviction():
    reg = LiveLoraRegistry(LoraCapacity(2, 2))
    lid = push(reg, 0, 0)
    reg.check_loaded(lid, [lid, 5])
    with pytest.raises(EvictedLoraError, match="no longer holds"):
        reg.check_loaded(lid, [])


def test_capacity_from_engine_kwargs():
    assert LoraCapacity.from_engine_kwargs({"max_loras": 8, "max_cpu_loras": 16}) == LoraCapacity(8, 16)
    assert LoraCapacity.from_engine_kwargs({"max_loras": 8}) == LoraCapacity(8, 8)
    with pytest.raises(ValueError, match="engine_kwargs.vllm.max_loras"):
        LoraCapacity.from_engine_kwargs({})


# --- server mixin over a fake verl server -------------------------------------------------------------------


class FakeAsyncLLM:
    def __init__(self):
        self.loaded: set[int] = set()
        self.seen: list[tuple[str, object]] = []

    async def list_loras(self):
        return set(self.loaded)

    def generate(self, prompt, sampling_params, request_id, lora_request=None, priority=0):
        self.seen.append((request_id, lora_request))

        async def gen():
            await asyncio.sleep(0.001 * (hash(request_id) % 5))
            yield ("out", request_id, lora_request)

        return gen()


class FakeVerlServer:
    """The parts of verl's vLLMHttpServer the mixin touches, with the installed verl's behaviour (see the module)."""

    def __init__(self, fail_rpc=False):
        self.fail_rpc = fail_rpc
        self.rpcs = []
        self.config = {"engine_kwargs": {"vllm": {"max_loras": 4, "max_cpu_loras": None}}}

    async def launch_server(self):
        engine_kwargs = {k: v for k, v in self.config["engine_kwargs"]["vllm"].items() if v is not None}
        if not MAX_LORAS:
            self._preprocess_engine_kwargs(engine_kwargs)
        args = types.SimpleNamespace(max_loras=int(engine_kwargs.get("max_loras") or 1) if MAX_LORAS else 1,
                                     max_cpu_loras=engine_kwargs.get("max_cpu_loras"))
        await self.run_server(args)
        return args

    def _preprocess_engine_kwargs(self, engine_kwargs):
        pass

    async def run_server(self, args):
        self.engine = FakeAsyncLLM()

    async def run_headless(self, args):
        pass

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, dict(kwargs or {})) if not args else (method, args))
        if self.fail_rpc:
            raise RuntimeError("IPC failed")
        if method == "remove_lora":  # vLLM's worker method
            self.engine_of().loaded.discard(args[0])
        elif method == "populora_remove_loras":  # the plugin's worker extension (verl 0.9.1)
            self.engine_of().loaded -= set(kwargs["lora_int_ids"])
        elif method == "update_weights_from_ipc" and kwargs.get("lora_targets") is not None:
            for t in kwargs["lora_targets"]:
                self.engine_of().loaded -= set(t["retire"])
                self.engine_of().loaded.add(t["lora_int_id"])
        elif method == "update_weights_from_ipc":
            assert not PER_ID_SYNC or set(kwargs) <= {"peft_config", "base_sync_done", "lora_int_id", "lora_name"}
            self.engine_of().loaded -= set(kwargs.get("retire_lora_int_ids") or ())
            self.engine_of().loaded.add(kwargs["lora_int_id"])

    def engine_of(self):
        return getattr(self.engine, "_engine", self.engine)

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, priority=0, **lora_kwargs):
        lora_request = None
        if PER_REQUEST and lora_kwargs.get("lora") is not None:  # verl's generate(lora=...)
            lora = lora_kwargs.pop("lora")
            if lora["lora_int_id"] not in await self.engine.list_loras():
                raise ValueError(f"LoRA adapter {lora['lora_int_id']} is not loaded in the vLLM engine")
            lora_request = (lora["lora_name"], lora["lora_int_id"])
        elif 123 in await self.engine.list_loras():  # verl's fixed adapter
            lora_request = ("123", 123)
        assert not lora_kwargs, lora_kwargs
        final = None
        async for out in self.engine.generate(prompt=prompt_ids, sampling_params=sampling_params,
                                              request_id=request_id, lora_request=lora_request, priority=priority):
            final = out
        return final


class Server(PopuLoRAServerMixin, FakeVerlServer):
    def _make_lora_request(self, lora_id, name):
        return (name, lora_id)


async def launched(**kw) -> Server:
    s = Server(**kw)
    args = await s.launch_server()
    assert (args.max_loras, args.max_cpu_loras) == (4, 4 if not MAX_LORAS else None)  # vLLM defaults it to max_loras
    assert s._populora_capacity == LoraCapacity(max_loras=4, max_cpu_loras=4)
    # verl 0.9.1: the engine is wrapped; with generate(lora=...) it is verl's own
    assert isinstance(s.engine, LoraRoutingEngine) != PER_REQUEST
    return s


async def sync(s: Server, slot: int, version: int, retire=()):
    await s.collective_rpc("update_weights_from_ipc", kwargs={
        "peft_config": PEFT, "base_sync_done": True, "lora_int_id": lora_int_id(slot, version, 4),
        "lora_name": lora_name(slot, version), "retire_lora_int_ids": list(retire)})


async def test_concurrent_requests_each_get_their_own_adapter():
    s = await launched()
    for slot in range(4):
        await sync(s, slot, 0)
    reqs = [(f"r{i}", i % 4) for i in range(24)]
    outs = await asyncio.gather(*[
        s.generate([1, 2], {}, rid, populora_lora={"lora_int_id": lora_int_id(slot, 0, 4)}) for rid, slot in reqs])
    for (rid, slot), out in zip(reqs, outs):
        assert out == ("out", rid, (lora_name(slot, 0), lora_int_id(slot, 0, 4)))
    assert current_lora_request() is None


async def test_requests_never_run_without_or_with_a_wrong_adapter():
    s = await launched()
    await sync(s, 0, 0)
    with pytest.raises(PopuLoRARoutingError, match="no 'populora'"):
        await s.generate([1], {}, "a")
    with pytest.raises(UnknownLoraError):
        await s.generate([1], {}, "b", populora_lora={"lora_int_id": lora_int_id(1, 0, 4)})
    # Evolution bumps slot 0 to v1: requests still naming v0 fail loudly.
    await sync(s, 0, 1, retire=[lora_int_id(0, 0, 4)])
    with pytest.raises(StaleLoraError):
        await s.generate([1], {}, "c", populora_lora={"lora_int_id": lora_int_id(0, 0, 4)})
    # Evicted from vLLM's cache behind our back.
    s.engine_of().loaded.clear()
    with pytest.raises(EvictedLoraError):
        await s.generate([1], {}, "d", populora_lora={"lora_int_id": lora_int_id(0, 1, 4)})
    if not PER_REQUEST:  # Direct engine use outside a PopuLoRA request is refused too.
        with pytest.raises(PopuLoRARoutingError):
            s.engine.generate(prompt=[1], sampling_params={}, request_id="e")
    assert all(req is not None for _, req in s.engine_of().seen)


async def test_failed_sync_leaves_adapter_unservable():
    s = await launched(fail_rpc=True)
    with pytest.raises(RuntimeError, match="IPC failed"):
        await sync(s, 0, 0)
    state = await s.populora_live_loras()
    assert state["live"] == {} and state["pending"] == {}
    # Non-LoRA RPCs pass straight through.
    s.fail_rpc = False
    await s.collective_rpc("monkey_patch_model", kwargs={"vocab_size": 3})
    assert s.rpcs[-1] == ("monkey_patch_model", {"vocab_size": 3})


async def test_retire_removes_from_registry_and_engine():
    s = await launched()
    await sync(s, 0, 0)
    await s.populora_retire_loras([lora_int_id(0, 0, 4)])
    if PER_ID_SYNC:  # vLLM's own remove_lora (the plugin's extension is not loaded)
        assert s.rpcs[-1] == ("remove_lora", (lora_int_id(0, 0, 4),))
    else:
        assert s.rpcs[-1] == ("populora_remove_loras", {"lora_int_ids": [lora_int_id(0, 0, 4)]})
    assert lora_int_id(0, 0, 4) not in s.engine_of().loaded
    with pytest.raises(StaleLoraError):
        await s.generate([1], {}, "x", populora_lora={"lora_int_id": lora_int_id(0, 0, 4)})


async def sync_several(s: Server, targets):
    await s.collective_rpc("update_weights_from_ipc", kwargs={
        "peft_config": PEFT, "base_sync_done": True,
        "lora_targets": [{"lora_int_id": lora_int_id(slot, v, 4), "lora_name": lora_name(slot, v),
                          "retire": list(retire)} for slot, v, retire in targets]})


@pytest.mark.skipif(not PER_ID_SYNC, reason="verl 0.9.1: the plugin's worker extension retires and loads")
async def test_an_adapter_sync_through_verl_retires_first_and_passes_verl_its_keys():
    s = await launched()
    await sync(s, 0, 0)
    await sync(s, 0, 1, retire=[lora_int_id(0, 0, 4)])
    # the old version leaves vLLM's cache before verl's extension loads the new one; verl gets only its keys
    assert [m for m, _ in s.rpcs] == ["update_weights_from_ipc", "remove_lora", "update_weights_from_ipc"]
    assert s.rpcs[-1][1] == {"peft_config": PEFT, "base_sync_done": True, "lora_int_id": lora_int_id(0, 1, 4),
                             "lora_name": lora_name(0, 1)}
    assert s.engine_of().loaded == {lora_int_id(0, 1, 4)}
    # verl would load an adapter without an id under its fixed 123; ids below the PopuLoRA range are not ours
    with pytest.raises(ValueError, match="needs lora_int_id"):
        await s.collective_rpc("update_weights_from_ipc", kwargs={"peft_config": PEFT, "base_sync_done": True})
    with pytest.raises(ValueError, match="not a PopuLoRA id"):
        await s.collective_rpc("update_weights_from_ipc", kwargs={
            "peft_config": PEFT, "base_sync_done": True, "lora_int_id": 123, "lora_name": "0@v0"})
    with pytest.raises(ValueError, match="worker extension"):
        await sync_several(s, [(1, 0, ())])
    state = await s.populora_live_loras()
    assert state["pending"] == {} and list(state["live"]) == [lora_int_id(0, 1, 4)]  # refused syncs rolled back


SEVERAL = pytest.mark.skipif(PER_ID_SYNC, reason="verl's per-id weight sync: one transfer per adapter (see below)")


@SEVERAL
async def test_several_adapters_in_one_transfer_go_live_together():
    s = await launched()
    await sync_several(s, [(slot, 0, ()) for slot in range(4)])
    assert len(s.rpcs) == 1
    for slot in range(4):
        out = await s.generate([1], {}, f"r{slot}", populora_lora={"lora_int_id": lora_int_id(slot, 0, 4)})
        assert out[2] == (lora_name(slot, 0), lora_int_id(slot, 0, 4))
    # evolution of slot 2 and training of slot 1 in one transfer: the old id of slot 2 is retired by it
    await sync_several(s, [(1, 0, ()), (2, 1, (lora_int_id(2, 0, 4),))])
    with pytest.raises(StaleLoraError):
        await s.generate([1], {}, "x", populora_lora={"lora_int_id": lora_int_id(2, 0, 4)})
    await s.generate([1], {}, "y", populora_lora={"lora_int_id": lora_int_id(2, 1, 4)})
    # a transfer that names one id twice, or forgets to retire a slot's old version, never starts
    with pytest.raises(ValueError, match="twice"):
        await sync_several(s, [(3, 0, ()), (3, 0, ())])
    with pytest.raises(LoraMismatchError):
        await sync_several(s, [(0, 0, ()), (3, 1, ())])
    state = await s.populora_live_loras()
    assert state["pending"] == {} and lora_int_id(0, 0, 4) in state["live"]  # the refused transfer rolled back


@SEVERAL
async def test_a_failed_several_adapter_transfer_leaves_every_id_unservable():
    s = await launched(fail_rpc=True)
    with pytest.raises(RuntimeError, match="IPC failed"):
        await sync_several(s, [(0, 0, ()), (1, 0, ())])
    state = await s.populora_live_loras()
    assert state["live"] == {} and state["pending"] == {}


def test_tagged_tensors_split_back_per_adapter_and_refuse_strays():
    a = [("m.lora_A.weight", 1), ("m.lora_B.weight", 2)]
    b = [("m.lora_A.weight", 3), ("m.lora_B.weight", 4)]
    items = list(tag_adapter_tensors(1000, a)) + list(tag_adapter_tensors(1001, b))
    assert split_adapter_tensors(items, [1000, 1001]) == {1000: dict(a), 1001: dict(b)}
    with pytest.raises(ValueError, match="got no tensors"):
        split_adapter_tensors(items, [1000, 1001, 1002])
    with pytest.raises(ValueError, match="outside this transfer"):
        split_adapter_tensors(items, [1000])
    with pytest.raises(ValueError, match="names no adapter"):
        split_adapter_tensors(a, [1000])
    with pytest.raises(ValueError, match="below"):
        lora_targets([{"lora_int_id": 5, "lora_name": "0@v0"}])


# --- verl registration and the agent loop -------------------------------------------------------------------


def test_register_is_lazy_and_idempotent():
    import populora_verl.rollout as rollout

    rollout.register()
    rollout.register()
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert "vllm" not in sys.modules, "register() must not import vLLM"
    assert "populora_verl.rollout.vllm_server" not in sys.modules
    assert RolloutReplicaRegistry._registry["populora_vllm"] is rollout._load_replica
    assert _ROLLOUT_REGISTRY[("populora_vllm", "async")] == rollout.server_adapter_fqn()
    assert _agent_loop_registry["populora_agent"] == {"_target_": "populora_verl.rollout.agent_loop.PopuLoRAAgentLoop"}
    assert all(rollout.registered().values())
    # verl's own vllm backend is untouched.
    assert _ROLLOUT_REGISTRY[("vllm", "async")] == "verl.workers.rollout.vllm_rollout.ServerAdapter"
    if "vllm" not in sys.modules:
        try:
            import vllm  # noqa: F401
        except ImportError:
            with pytest.raises((ImportError, ValueError)):
                RolloutReplicaRegistry.get("populora_vllm")


async def test_agent_loop_passes_prompt_adapter(monkeypatch):
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from populora_verl.rollout.agent_loop import LoraInjectingClient, PopuLoRAAgentLoop, _forwards_lora_field

    forwards = _forwards_lora_field()
    key = "lora" if forwards else "populora_lora"
    calls = []

    class Client:
        async def generate(self, **kw):
            calls.append(kw)
            return kw[key]["lora_int_id"]

    async def fake_parent_run(self, sampling_params, **kwargs):
        # SingleTurnAgentLoop.run calls server_manager.generate with a fixed argument list: verl 0.9.1 forwards no
        # prompt field, the series forwards "lora".
        extra = {"lora": dict(kwargs["lora"])} if forwards and kwargs.get("lora") is not None else {}
        out = await self.server_manager.generate(request_id="r", prompt_ids=[1], sampling_params=sampling_params,
                                                 **extra)
        return types.SimpleNamespace(extra_fields={"served": out})

    monkeypatch.setattr(SingleTurnAgentLoop, "run", fake_parent_run)
    loop = PopuLoRAAgentLoop.__new__(PopuLoRAAgentLoop)
    loop.server_manager = Client() if forwards else LoraInjectingClient(Client())
    outs = await asyncio.gather(*[
        loop.run({}, raw_prompt=[], populora={"lora_int_id": 1000 + i, "lora_name": f"{i}@v0", "role": "student"})
        for i in range(5)])
    assert [o.extra_fields["served"] for o in outs] == [1000 + i for i in range(5)]
    assert [o.extra_fields["populora_lora_int_id"] for o in outs] == [1000 + i for i in range(5)]
    assert calls[0][key] == {"lora_int_id": 1000, "lora_name": "0@v0"}
    with pytest.raises(PopuLoRARoutingError, match="no 'populora'"):
        await loop.run({}, raw_prompt=[])
    if not forwards:
        with pytest.raises(RuntimeError, match="outside"):
            await loop.server_manager.generate(request_id="x")


async def test_a_plain_text_prompt_is_capped_to_the_prompt_length(monkeypatch):
    """A prompt_format=text prompt is tokenized by the plugin and left-truncated to rollout.prompt_length as verl
    caps a chat prompt (through verl's public cap_text_prompt_length where verl has it, patches/0013)."""
    from populora_verl.rollout import agent_loop as al

    monkeypatch.setattr("populora_verl.tasks.prompts.encode_prompt", lambda tok, text: list(range(len(text))))
    loop = al.PopuLoRAAgentLoop.__new__(al.PopuLoRAAgentLoop)
    loop.loop = asyncio.get_running_loop()
    loop.tokenizer = object()
    loop.rollout_config = types.SimpleNamespace(prompt_length=4)
    for text, expected in (("abcdefgh", [4, 5, 6, 7]), ("abc", [0, 1, 2])):
        token = al._PROMPT_TEXT.set(text)
        try:
            assert await loop.ct_build_initial_tokens([{"role": "user", "content": text}]) == expected
        finally:
            al._PROMPT_TEXT.reset(token)
