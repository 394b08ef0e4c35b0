"""LoRA ids for vLLM and the server-side registry of live adapters (pure Python, no vLLM).

**Id scheme.** Adapter-bank slot ``s`` at weight version ``v`` (``v`` is bumped whenever evolution or a driver write
replaces the slot's weights; training steps keep it) is served by vLLM as::

    lora_int_id = LORA_ID_BASE + v * num_slots + s        lora_name = f"{s}@v{v}"

Guarantees, for a run with a fixed number of slots:

* one id per (slot, version) and one (slot, version) per id (the map is a bijection onto ids >= LORA_ID_BASE);
* ids never collide with verl's single-adapter id 123 (``VLLM_LORA_INT_ID``);
* an id is never reused for different weights *across versions*: a request built before an evolution step names a
  retired id and fails loudly instead of being served by the child that took the slot. Within one version the id's
  weights are replaced in place by every training step's weight sync, which only happens while the rollout is asleep
  (sync trainer), and verl clears the KV/prefix cache after every sync.

**Registry.** :class:`LiveLoraRegistry` is what the vLLM server consults before every request: which ids are live
(id -> name), which were retired, and how many may be resident (``max_cpu_loras``). Adapters reach vLLM as tensors
with a dummy path, so an adapter evicted from vLLM's CPU cache cannot be reloaded: the registry refuses to hold more
live ids than ``max_cpu_loras`` and :meth:`LiveLoraRegistry.check_loaded` turns an eviction into an error.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "LORA_ID_BASE",
    "POPULORA_FIELD",
    "PopuLoRARoutingError",
    "UnknownLoraError",
    "StaleLoraError",
    "LoraMismatchError",
    "EvictedLoraError",
    "LoraCapacityError",
    "LoraCapacity",
    "LiveLoraRegistry",
    "lora_int_id",
    "lora_name",
    "decode_lora_int_id",
    "parse_lora_name",
    "adapter_sync_target",
    "lora_spec_from_prompt",
    "LoraTarget",
    "lora_targets",
    "tag_adapter_tensors",
    "split_adapter_tensors",
]

LORA_ID_BASE = 1000
#: The prompt field (a dict per prompt) that carries routing data: ``lora_int_id`` (required), ``lora_name``,
#: ``slot``, ``role``, ``task`` ...; verl copies every prompt field into ``AgentLoopBase.run(**kwargs)``.
POPULORA_FIELD = "populora"
_NAME = re.compile(r"^(\d+)@v(\d+)$")


class PopuLoRARoutingError(RuntimeError):
    """A generation request cannot be served with the adapter it names (never silently served without it)."""


class UnknownLoraError(PopuLoRARoutingError):
    pass


class StaleLoraError(PopuLoRARoutingError):
    pass


class LoraMismatchError(PopuLoRARoutingError):
    pass


class EvictedLoraError(PopuLoRARoutingError):
    pass


class LoraCapacityError(PopuLoRARoutingError):
    pass


def _nonneg_int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise ValueError(f"{what} must be an integer, got {x!r}")
    x = int(x)
    if x < 0:
        raise ValueError(f"{what} must be >= 0, got {x}")
    return x


def lora_int_id(slot: int, version: int, num_slots: int) -> int:
    """The vLLM ``lora_int_id`` of ``slot`` at weight ``version`` (see the module docstring)."""
    slot, version, num_slots = (
        _nonneg_int(slot, "slot"),
        _nonneg_int(version, "version"),
        _nonneg_int(num_slots, "num_slots"),
    )
    if num_slots < 1 or slot >= num_slots:
        raise ValueError(f"slot {slot} out of range for {num_slots} slots")
    return LORA_ID_BASE + version * num_slots + slot


def decode_lora_int_id(lora_id: int, num_slots: int) -> tuple[int, int]:
    """Inverse of :func:`lora_int_id`: ``(slot, version)``."""
    lora_id, num_slots = _nonneg_int(lora_id, "lora_int_id"), _nonneg_int(num_slots, "num_slots")
    if lora_id < LORA_ID_BASE or num_slots < 1:
        raise ValueError(f"{lora_id} is not a PopuLoRA lora_int_id (ids start at {LORA_ID_BASE})")
    version, slot = divmod(lora_id - LORA_ID_BASE, num_slots)
    return slot, version


def lora_name(slot: int, version: int) -> str:
    return f"{_nonneg_int(slot, 'slot')}@v{_nonneg_int(version, 'version')}"


def parse_lora_name(name: str) -> tuple[int, int]:
    m = _NAME.match(name) if isinstance(name, str) else None
    if not m:
        raise ValueError(f"{name!r} is not a PopuLoRA lora_name ('<slot>@v<version>')")
    return int(m.group(1)), int(m.group(2))


def adapter_sync_target(
    peft_config: Any, base_sync_done: Any, lora_int_id: Any, lora_name: Any
) -> tuple[int, str] | None:
    """The ``(lora_int_id, lora_name)`` a weight-sync call loads its adapter under, or None for a call that syncs no
    adapter (base or full weights). An adapter sync without an id is refused: verl would load it under its fixed id
    123, which no PopuLoRA request names."""
    adapter_sync = bool(peft_config and base_sync_done)
    if lora_int_id is None:
        if adapter_sync:
            raise ValueError("populora_vllm adapter sync needs lora_int_id and lora_name (see PopuLoRA worker)")
        return None
    if not adapter_sync:
        raise ValueError("lora_int_id is only meaningful for an adapter sync (peft_config and base_sync_done)")
    lora_id = int(lora_int_id)
    if lora_id < LORA_ID_BASE:
        raise ValueError(f"lora_int_id {lora_id} is not a PopuLoRA id (>= {LORA_ID_BASE})")
    parse_lora_name(lora_name)
    return lora_id, str(lora_name)


def lora_spec_from_prompt(populora: Any) -> dict[str, Any]:
    """``{"lora_int_id", "lora_name"}`` from a prompt's ``populora`` field; a clear error when it is unusable."""
    if populora is None:
        raise PopuLoRARoutingError(
            f"prompt has no '{POPULORA_FIELD}' field: every PopuLoRA request must name its adapter"
        )
    if not isinstance(populora, Mapping):
        raise PopuLoRARoutingError(f"'{POPULORA_FIELD}' must be a mapping, got {type(populora).__name__}")
    if populora.get("lora_int_id") is None:
        raise PopuLoRARoutingError(f"'{POPULORA_FIELD}' lacks 'lora_int_id' (has {sorted(populora)})")
    try:
        lid = _nonneg_int(populora["lora_int_id"], "lora_int_id")
    except ValueError as e:
        raise PopuLoRARoutingError(str(e)) from None
    name = populora.get("lora_name")
    return {"lora_int_id": lid, "lora_name": None if name is None else str(name)}


# --- several adapters in one weight transfer ---------------------------------------------------------------------

#: tensor names of a several-adapter transfer: ``populora_adapter/<lora_int_id>/<PEFT key>``
ADAPTER_TAG = "populora_adapter/"


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """One adapter of a weight transfer: the id and name it is served under, and the ids it retires."""

    lora_int_id: int
    lora_name: str
    retire: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"lora_int_id": self.lora_int_id, "lora_name": self.lora_name, "retire": list(self.retire)}


def lora_targets(raw: Iterable[Mapping[str, Any] | LoraTarget]) -> list[LoraTarget]:
    """Checked targets of a several-adapter transfer: PopuLoRA ids and names, each id once."""
    out: list[LoraTarget] = []
    for t in raw:
        t = (
            t
            if isinstance(t, LoraTarget)
            else LoraTarget(
                lora_int_id=_nonneg_int(t.get("lora_int_id"), "lora_int_id"),
                lora_name=str(t.get("lora_name")),
                retire=tuple(_nonneg_int(r, "retired lora_int_id") for r in (t.get("retire") or ())),
            )
        )
        if t.lora_int_id < LORA_ID_BASE:
            raise ValueError(f"lora_int_id {t.lora_int_id} is below {LORA_ID_BASE}: not a PopuLoRA id")
        parse_lora_name(t.lora_name)
        out.append(t)
    ids = [t.lora_int_id for t in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a weight transfer names lora_int_id twice: {ids}")
    return out


def tag_adapter_tensors(lora_id: int, items: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """One adapter's ``(name, tensor)`` pairs named for a several-adapter transfer."""
    lora_id = _nonneg_int(lora_id, "lora_int_id")
    for name, t in items:
        yield f"{ADAPTER_TAG}{lora_id}/{name}", t


def split_adapter_tensors(items: Iterable[tuple[str, Any]], lora_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The tensors of a several-adapter transfer, per adapter; an untagged or unexpected tensor, or an adapter with
    none, is an error (an adapter must never be served with another's weights or with half of its own)."""
    want = [int(i) for i in lora_ids]
    out: dict[int, dict[str, Any]] = {i: {} for i in want}
    for name, t in items:
        if not name.startswith(ADAPTER_TAG):
            raise ValueError(f"tensor {name!r} of a several-adapter transfer names no adapter")
        lid, _, key = name[len(ADAPTER_TAG) :].partition("/")
        if not lid.isdigit() or int(lid) not in out or not key:
            raise ValueError(f"tensor {name!r} names an adapter outside this transfer {want}")
        out[int(lid)][key] = t
    empty = [i for i, d in out.items() if not d]
    if empty:
        raise ValueError(f"adapters {empty} got no tensors in this transfer")
    return out


@dataclasses.dataclass(frozen=True)
class LoraCapacity:
    """vLLM multi-LoRA capacity: ``max_loras`` adapters per batch on GPU, ``max_cpu_loras`` resident in the cache."""

    max_loras: int
    max_cpu_loras: int

    def __post_init__(self) -> None:
        if not (isinstance(self.max_loras, int) and self.max_loras >= 1):
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if not (isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras):
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras ({self.max_loras})"
            )

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: Mapping[str, Any] | None) -> LoraCapacity:
        """Read ``rollout.engine_kwargs.vllm.{max_loras, max_cpu_loras}`` (verl forces ``max_loras=1`` after merging
        them, which the PopuLoRA server undoes). ``max_cpu_loras`` defaults to ``max_loras``."""
        ek = dict(engine_kwargs or {})
        if ek.get("max_loras") is None:
            raise ValueError(
                "rollout populora_vllm needs actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras "
                "(>= population size) so every adapter of a batch is resident on the GPU"
            )
        ml = int(ek["max_loras"])
        mc = int(ek["max_cpu_loras"]) if ek.get("max_cpu_loras") is not None else ml
        return cls(max_loras=ml, max_cpu_loras=mc)


class LiveLoraRegistry:
    """Which LoRA ids a vLLM server may serve right now.

    An update is two-phase: :meth:`begin_update` takes the id (and the ids it retires) out of service before the
    weights move, :meth:`commit_update` puts it back once vLLM holds the new weights. A failed update leaves the id
    out of service, so requests for it fail instead of being served half-updated weights.
    """

    def __init__(self, capacity: LoraCapacity) -> None:
        self.capacity = capacity
        self._live: dict[int, str] = {}
        self._retired: dict[int, str] = {}
        self._pending: dict[int, str] = {}

    @property
    def live(self) -> dict[int, str]:
        return dict(self._live)

    @property
    def retired(self) -> dict[int, str]:
        return dict(self._retired)

    def begin_update(self, lora_id: int, name: str, retire: Iterable[int] = ()) -> None:
        lora_id = _nonneg_int(lora_id, "lora_int_id")
        if lora_id < LORA_ID_BASE:
            raise ValueError(f"lora_int_id {lora_id} is below {LORA_ID_BASE}: not a PopuLoRA id")
        slot, _ = parse_lora_name(name)
        if lora_id in self._retired:
            raise StaleLoraError(f"lora_int_id {lora_id} was retired ({self._retired[lora_id]}); ids are never reused")
        retire = {_nonneg_int(r, "retired lora_int_id") for r in retire}
        if lora_id in retire:
            raise ValueError(f"update of lora_int_id {lora_id} also retires it")
        # One live id per slot: the previous version of this slot must be retired by this very update.
        for lid, other in self._live.items():
            if lid != lora_id and lid not in retire and parse_lora_name(other)[0] == slot:
                raise LoraMismatchError(
                    f"slot {slot} would have two live adapters ({other} as {lid} and {name} as {lora_id}): "
                    "retire the old version in the same update"
                )
        if lora_id in self._live and self._live[lora_id] != name:
            raise LoraMismatchError(f"lora_int_id {lora_id} is live as {self._live[lora_id]}, cannot become {name}")
        after = (set(self._live) - retire) | {lora_id}
        if len(after) > self.capacity.max_cpu_loras:
            raise LoraCapacityError(
                f"{len(after)} live adapters exceed max_cpu_loras={self.capacity.max_cpu_loras}: vLLM would evict "
                "tensor-loaded adapters it cannot reload; raise engine_kwargs.vllm.max_cpu_loras"
            )
        for r in retire:
            self._retired[r] = self._live.pop(r, self._retired.get(r, "?"))
        self._live.pop(lora_id, None)
        self._pending[lora_id] = name

    def commit_update(self, lora_id: int) -> None:
        if lora_id not in self._pending:
            raise ValueError(f"no update of lora_int_id {lora_id} in progress")
        self._live[lora_id] = self._pending.pop(lora_id)

    def abort_update(self, lora_id: int) -> None:
        """The weight move failed: the id stays out of service (requests naming it raise)."""
        self._pending.pop(lora_id, None)

    def retire(self, ids: Iterable[int]) -> None:
        for r in ids:
            r = _nonneg_int(r, "lora_int_id")
            self._retired[r] = self._live.pop(r, self._retired.get(r, "?"))

    def resolve(self, lora_id: int, name: str | None = None) -> tuple[int, str]:
        """The (id, name) to serve, or an error saying why the request must not run."""
        lora_id = _nonneg_int(lora_id, "lora_int_id")
        if lora_id in self._live:
            live_name = self._live[lora_id]
            if name is not None and name != live_name:
                raise LoraMismatchError(f"request names {name} but lora_int_id {lora_id} serves {live_name}")
            return lora_id, live_name
        if lora_id in self._retired:
            raise StaleLoraError(
                f"lora_int_id {lora_id} ({self._retired[lora_id]}) was retired by evolution; the request was built "
                "for an adapter that no longer exists"
            )
        if lora_id in self._pending:
            raise UnknownLoraError(f"lora_int_id {lora_id} is being updated (or its update failed): not servable")
        raise UnknownLoraError(f"lora_int_id {lora_id} was never pushed to this server (live: {sorted(self._live)})")

    def check_loaded(self, lora_id: int, loaded: Iterable[int]) -> None:
        """Raise if vLLM no longer holds a live id (evicted: it cannot be reloaded from its dummy path)."""
        if lora_id not in set(loaded):
            raise EvictedLoraError(
                f"lora_int_id {lora_id} ({self._live.get(lora_id, '?')}) is live but vLLM no longer holds it "
                f"(evicted? max_cpu_loras={self.capacity.max_cpu_loras}); push the adapters again"
            )

    def state(self) -> dict[str, Any]:
        return {
            "live": self.live,
            "retired": self.retired,
            "pending": dict(self._pending),
            "max_loras": self.capacity.max_loras,
            "max_cpu_loras": self.capacity.max_cpu_loras,
        }
