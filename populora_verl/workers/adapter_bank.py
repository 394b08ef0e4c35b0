"""AdapterBank: N LoRA adapters time-sharing one live PEFT adapter (phase-1 design, reference §9).

verl's FSDP engine builds exactly one PEFT adapter (``"default"``), one optimizer and one LR scheduler. Instead of
teaching every verl helper about N adapters, the bank keeps, per slot and per rank, a CPU copy of

* the rank's **local shard** of every LoRA parameter (``DTensor.to_local()`` under FSDP2, the tensor itself
  otherwise),
* the optimizer state of those parameters (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``; any per-parameter tensor
  state is carried, so other torch optimizers work too),
* the LR scheduler state and the param-group learning rates,

and copies a slot into the live adapter before a call that uses it (:meth:`AdapterBank.swap_in`) and back after a
call that changed it (:meth:`AdapterBank.swap_out`). Swaps are rank-local ``copy_`` calls with no collectives, so
verl's clipping, weight sync, reference policy and offload keep working unchanged, and each slot gets its own
optimizer step count and LR schedule.

Only :meth:`get_adapter_state` / :meth:`set_adapter_state` (full tensors in PEFT key format, for the SVD-based
operators and for checkpoints a user can open) touch other ranks: under FSDP2 they all-gather or re-shard, so every
rank must call them in the same order (the worker's ONE_TO_ALL RPCs guarantee that).

Pure torch + PEFT naming; no verl import.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "AdapterBank",
    "AdapterBankError",
    "PlanEntry",
    "peft_key",
    "bank_filename",
    "bank_file_for",
    "BANK_FORMAT_VERSION",
    "default_lora_init",
    "shard_like",
    "apply_evolution_plan",
    "EVOLUTION_PHASES",
    "validate_adapter_state",
    "check_saved_bank",
    "save_atomically",
]

BANK_FORMAT_VERSION = 1

#: The phases of an evolution event that :func:`apply_evolution_plan` times, in the order of the trainer's line.
EVOLUTION_PHASES = ("operator", "gather", "scatter", "optimizer")


class AdapterBankError(RuntimeError):
    """Misuse of the bank or a state dict that does not fit it (one line, names the slot or key)."""


def _is_dtensor(t: Any) -> bool:
    # Checked by attribute so plain-tensor users never import torch.distributed.tensor.
    return hasattr(t, "to_local") and hasattr(t, "device_mesh") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage behind a (possibly sharded) tensor."""
    return t.to_local() if _is_dtensor(t) else t


def _wait_for_copies() -> None:
    """Block until the copies queued on this rank's accelerator are done (swaps queue theirs without waiting, see
    :meth:`AdapterBank.swap_in`). The whole device, not one tensor's: with verl's parameter offload the weights may
    sit on the CPU while the optimizer moments stay on the GPU."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def _comm_device(t: Any) -> torch.device:
    """Where a DTensor's collectives run: its mesh's device, even while the parameter is offloaded to CPU."""
    kind = t.device_mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, kind)
    return torch.device(kind, mod.current_device())


def peft_key(param_name: str, adapter_name: str = "default") -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` (PEFT ``get_peft_model_state_dict`` keys).

    FSDP1 wrapper prefixes are stripped too so a key never depends on how the model was wrapped.
    """
    name = param_name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    parts = name.split(".")
    if adapter_name not in parts:
        raise AdapterBankError(f"parameter {param_name!r} does not belong to adapter {adapter_name!r}")
    return ".".join(p for p in parts if p != adapter_name)


@dataclasses.dataclass
class PlanEntry:
    """One child of an evolution plan, as the bank applies it.

    ``parent_slots`` are ordered fittest first (docs/CONTRACTS.md). ``seed`` must be identical on every rank: the
    operator runs on full tensors on every rank and each rank keeps its own shard of the (identical) child.
    """

    child_slot: int
    operator: str
    parent_slots: Sequence[int]
    seed: int
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reset_optimizer: bool = True

    @classmethod
    def coerce(cls, entry: PlanEntry | Mapping[str, Any] | Any) -> PlanEntry:
        if isinstance(entry, PlanEntry):
            return entry
        get = entry.get if isinstance(entry, Mapping) else (lambda k, d=None: getattr(entry, k, d))
        missing = [k for k in ("child_slot", "operator", "parent_slots", "seed") if get(k) is None]
        if missing:
            raise AdapterBankError(f"plan entry {entry!r} lacks {missing}")
        return cls(
            child_slot=int(get("child_slot")),
            operator=str(get("operator")),
            parent_slots=[int(s) for s in get("parent_slots")],
            seed=int(get("seed")),
            params=dict(get("params") or {}),
            reset_optimizer=bool(get("reset_optimizer", True)),
        )


@dataclasses.dataclass
class _Slot:
    params: dict[str, torch.Tensor]  # param name -> CPU copy of the local shard
    optim: dict[str, dict[str, Any]] | None = None  # param name -> optimizer state (CPU); None: fresh optimizer
    scheduler: dict[str, Any] | None = None  # LR scheduler state_dict; None: the schedule's initial state
    lrs: list[float] | None = None  # param-group LRs; None: the initial LRs
    version: int = 0  # bumped whenever the weights change other than by training (evolution, set, reset)
    updates: int = 0  # training calls made with this slot active


class AdapterBank:
    """Per-slot CPU copies of one live PEFT adapter's local shards, optimizer and scheduler state.

    Args:
        model: the (possibly FSDP2-sharded) PEFT model that holds the live adapter.
        optimizer: the optimizer over the model's parameters, or ``None`` for a forward-only model.
        lr_scheduler: its LR scheduler (any ``torch.optim.lr_scheduler`` with ``state_dict``), or ``None``.
        adapter_name: the live PEFT adapter (verl: ``"default"``).
        pin_memory: pin the CPU copies (default: when CUDA is available), for fast host<->device copies.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        *,
        adapter_name: str = "default",
        pin_memory: bool | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.adapter_name = adapter_name
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._params: dict[str, torch.nn.Parameter] = self._find_adapter_params(model, adapter_name)
        self._keys = {name: peft_key(name, adapter_name) for name in self._params}
        self._by_key = {k: n for n, k in self._keys.items()}
        if len(self._by_key) != len(self._keys):
            raise AdapterBankError("two adapter parameters map to the same PEFT key")
        if optimizer is not None:
            owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
            missing = [n for n, p in self._params.items() if id(p) not in owned]
            if missing:
                raise AdapterBankError(f"optimizer does not own adapter parameters {missing[:3]}...")
        # The schedule every fresh slot starts from (captured before any slot trains).
        self._initial_scheduler = copy.deepcopy(lr_scheduler.state_dict()) if lr_scheduler is not None else None
        self._initial_lrs = [g["lr"] for g in optimizer.param_groups] if optimizer is not None else None
        self._slots: list[_Slot] = []
        self._active: int | None = None  # slot whose weights the live adapter holds
        self._dirty = False  # live adapter changed since it was loaded from / written to the active slot

    # --- discovery -------------------------------------------------------------------------------------------

    @staticmethod
    def _find_adapter_params(model: torch.nn.Module, adapter_name: str) -> dict[str, torch.nn.Parameter]:
        params: dict[str, torch.nn.Parameter] = {}
        for name, p in model.named_parameters():
            if adapter_name in name.split(".") and ("lora_" in name):
                if type(p).__name__ == "FlatParameter" or "_flat_param" in name:
                    raise AdapterBankError(
                        "FSDP1 flat parameters cannot be swapped per adapter: use actor.strategy=fsdp2"
                    )
                params[name] = p
        if not params:
            flat = [n for n, _ in model.named_parameters() if "_flat_param" in n]
            if flat:
                raise AdapterBankError("FSDP1 flat parameters cannot be swapped per adapter: use actor.strategy=fsdp2")
            raise AdapterBankError(f"model has no LoRA parameters of adapter {adapter_name!r}")
        return params

    # --- introspection ---------------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def active_slot(self) -> int | None:
        """The slot whose weights the live adapter holds (``None``: none, e.g. right after a load)."""
        return self._active

    @property
    def param_names(self) -> list[str]:
        return list(self._params)

    @property
    def peft_keys(self) -> list[str]:
        return [self._keys[n] for n in self._params]

    def slot_info(self, slot: int) -> dict[str, int]:
        """Counters of one slot: weight ``version``, training ``updates`` and the optimizer ``step``."""
        self._check_slot(slot)
        if self._active == slot:
            self.swap_out()
        s = self._slots[slot]
        return {"version": s.version, "updates": s.updates, "optimizer_step": self._optimizer_step(s)}

    def version(self, slot: int) -> int:
        self._check_slot(slot)
        return self._slots[slot].version

    @staticmethod
    def _optimizer_step(s: _Slot) -> int:
        if not s.optim:
            return 0
        steps = [st.get("step") for st in s.optim.values() if "step" in st]
        return int(max(float(x) for x in steps)) if steps else 0

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(self._slots):
            raise AdapterBankError(f"slot {slot!r} out of range: the bank has {len(self._slots)} slots")

    # --- CPU buffers -----------------------------------------------------------------------------------------

    def _cpu_copy(self, t: torch.Tensor) -> torch.Tensor:
        t = _local(t.detach())
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        out.copy_(t)
        return out

    def _into(self, dst: torch.Tensor | None, src: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """Copy ``src`` into an existing CPU buffer (reused across swaps) or a new one.

        ``non_blocking``: a copy from a device may still be running on return (the caller waits once for all)."""
        src = _local(src.detach())
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            return self._cpu_copy(src)
        dst.copy_(src, non_blocking=non_blocking)
        return dst

    # --- slots -----------------------------------------------------------------------------------------------

    def init_slots(
        self, num_slots: int, seed: int | None = None, *, from_live: bool = False, shared_a: bool = False
    ) -> None:
        """Create ``num_slots`` slots with fresh optimizer state.

        ``from_live``: every slot starts as a copy of the live adapter (e.g. a pretrained ``lora_adapter_path``).
        Otherwise slot k gets PEFT's default LoRA init drawn from ``seed`` and k: ``lora_A`` Kaiming-uniform
        (bound ``1/sqrt(fan_in)``), ``lora_B`` zero, so every adapter starts as the base policy but trains from a
        different subspace. ``shared_a``: every slot gets slot 0's draw instead (one gauge for the whole
        population, so factor-space crossovers of founders are meaningful). Full tensors are drawn identically on
        every rank and each rank keeps its shard.
        """
        if not isinstance(num_slots, int) or num_slots < 1:
            raise AdapterBankError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        if not from_live and seed is None:
            raise AdapterBankError("init_slots needs a seed unless from_live=True")
        self._slots = []
        self._active = None
        self._dirty = False
        for k in range(num_slots):
            if from_live:
                params = {n: self._cpu_copy(p) for n, p in self._params.items()}
            else:
                gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + (0 if shared_a else k))
                params = {}
                for n, p in self._params.items():
                    full = default_lora_init(n, tuple(p.shape), gen)
                    params[n] = self._cpu_copy(shard_like(full.to(p.dtype), p))
            self._slots.append(_Slot(params=params))
        self._drop_live_optimizer_state()

    def swap_in(self, slot: int, *, train: bool = True) -> None:
        """Load ``slot`` into the live adapter (writing the previously active slot back first if it changed).

        ``train=False`` promises the caller will not change the weights (log-probs, weight sync), so the next swap
        skips the write-back.
        """
        self._check_slot(slot)
        if self._active == slot:
            self._dirty = self._dirty or train
            return
        self.swap_out()
        s = self._slots[slot]
        # named in torch profiles (python -m populora_verl.bench.trace_summary lists it as a stage)
        # A swap is about 1,200 small copies (weights and optimizer moments). Each blocking host<->device copy waits
        # for the GPU, so they are queued without waiting and the swap waits once at the end; under no_grad,
        # to_local() is the DTensor's own local tensor, where p.data would dispatch a detach per parameter.
        with torch.profiler.record_function("populora_bank_swap_in"), torch.no_grad():
            for n, p in self._params.items():
                _local(p).copy_(s.params[n], non_blocking=True)
                p.grad = None
            self._load_optimizer(s)
            _wait_for_copies()
        self._active = slot
        self._dirty = train

    def swap_out(self) -> None:
        """Write the live adapter back into the active slot if it changed; the live adapter keeps its weights."""
        if self._active is None or not self._dirty:
            return
        s = self._slots[self._active]
        with torch.profiler.record_function("populora_bank_swap_out"), torch.no_grad():
            for n, p in self._params.items():
                s.params[n] = self._into(s.params.get(n), _local(p), non_blocking=True)
            self._save_optimizer(s)
            _wait_for_copies()  # the slot's CPU copies are read next
        self._dirty = False

    @contextlib.contextmanager
    def active(self, slot: int, *, train: bool = True) -> Iterator[int]:
        """``with bank.active(k):`` run one call on slot k; a training call's result is written back on exit."""
        self.swap_in(slot, train=train)
        try:
            yield slot
        finally:
            if train:
                self._slots[slot].updates += 1
                self.swap_out()

    # --- optimizer / scheduler -------------------------------------------------------------------------------

    def _drop_live_optimizer_state(self) -> None:
        if self.optimizer is not None:
            for p in self._params.values():
                self.optimizer.state.pop(p, None)

    def _save_optimizer(self, s: _Slot) -> None:
        if self.optimizer is None:
            return
        out: dict[str, dict[str, Any]] = {}
        for n, p in self._params.items():
            live = self.optimizer.state.get(p)
            if not live:
                continue
            old = (s.optim or {}).get(n, {})
            st: dict[str, Any] = {}
            for key, val in live.items():
                if torch.is_tensor(val):
                    st[key] = self._into(old.get(key), _local(val), non_blocking=True)
                    st[f"__device__{key}"] = str(_local(val).device)
                else:
                    st[key] = copy.deepcopy(val)
            out[n] = st
        s.optim = out or None
        if self.lr_scheduler is not None:
            s.scheduler = copy.deepcopy(self.lr_scheduler.state_dict())
        s.lrs = [g["lr"] for g in self.optimizer.param_groups]

    def _load_optimizer(self, s: _Slot) -> None:
        if self.optimizer is None:
            return
        for n, p in self._params.items():
            saved = (s.optim or {}).get(n)
            if not saved:
                # Fresh slot: AdamW lazily creates zero moments and step 0 at its next step, as for a new optimizer.
                self.optimizer.state.pop(p, None)
                continue
            live = self.optimizer.state[p]
            for key in [k for k in live if k not in saved]:
                del live[key]
            for key, val in saved.items():
                if key.startswith("__device__"):
                    continue
                if not torch.is_tensor(val):
                    live[key] = copy.deepcopy(val)
                    continue
                cur = live.get(key)
                if cur is None or _local(cur).shape != val.shape:
                    if val.shape == _local(p).shape and val.dim() > 0:
                        cur = torch.zeros_like(p, dtype=val.dtype)  # keeps the DTensor layout of the parameter
                    else:
                        # CPU stays CPU; an accelerator tensor (e.g. a fused AdamW step) goes to this rank's device,
                        # not the saved index: a bank resumed on another GPU numbering must still load.
                        was_cpu = str(saved.get(f"__device__{key}", "cpu")).startswith("cpu")
                        cur = torch.empty(val.shape, dtype=val.dtype, device="cpu" if was_cpu else _local(p).device)
                    live[key] = cur
                _local(cur).copy_(val, non_blocking=True)
        _wait_for_copies()  # s.optim may change once this returns
        sched = s.scheduler if s.scheduler is not None else self._initial_scheduler
        if self.lr_scheduler is not None and sched is not None:
            self.lr_scheduler.load_state_dict(copy.deepcopy(sched))
        lrs = s.lrs if s.lrs is not None else self._initial_lrs
        for g, lr in zip(self.optimizer.param_groups, lrs or []):
            g["lr"] = lr

    def reset_optimizer(self, slot: int, *, reset_scheduler: bool = True) -> None:
        """Give ``slot`` a fresh optimizer (zero moments, step 0) and, by default, restart its LR schedule."""
        self._check_slot(slot)
        if self._active == slot:
            self.swap_out()
        s = self._slots[slot]
        s.optim = None
        if reset_scheduler:
            s.scheduler, s.lrs = None, None
        if self._active == slot:
            self._load_optimizer(s)

    def copy_optimizer(self, src: int, dst: int) -> None:
        """Give slot ``dst`` a copy of slot ``src``'s optimizer moments, step count, LR schedule and LRs.

        Rank-local (both slots hold this rank's shards of same-shaped parameters): used when a child keeps its
        fitter parent's optimizer state (``pbt.reset_optimizer_on_replace=false``), as the CPU driver does.
        """
        self._check_slot(src)
        self._check_slot(dst)
        if self._active in (src, dst):
            self.swap_out()
        s, d = self._slots[src], self._slots[dst]
        if src != dst:
            old = d.optim or {}
            # into dst's own buffers where they fit: they stay pinned, and nothing is allocated
            d.optim = (
                None
                if s.optim is None
                else {
                    n: {k: self._copy_state(old.get(n, {}).get(k), v) for k, v in st.items()}
                    for n, st in s.optim.items()
                }
            )
            d.scheduler, d.lrs = copy.deepcopy(s.scheduler), copy.deepcopy(s.lrs)
        if self._active == dst:
            self._load_optimizer(d)

    @staticmethod
    def _copy_state(dst: Any, val: Any) -> Any:
        if not torch.is_tensor(val):
            return copy.deepcopy(val)
        if torch.is_tensor(dst) and dst.shape == val.shape and dst.dtype == val.dtype and dst.device == val.device:
            return dst.copy_(val)
        return val.clone()

    # --- full adapter state dicts (PEFT keys) ----------------------------------------------------------------

    def get_adapter_state(self, slot: int, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """Slot ``slot`` as a PEFT adapter state dict of full tensors (collective under FSDP2).

        ``to_cpu=False`` leaves each full tensor where the gather made it (the accelerator under FSDP2; without
        sharding, a copy on the live parameter's device), so that evolution's operators run there: the copies are
        queued without waiting per tensor, and the call waits once at the end.
        """
        self._check_slot(slot)
        if self._active == slot:
            self.swap_out()
        s = self._slots[slot]
        out: dict[str, torch.Tensor] = {}
        for n, p in self._params.items():
            local = s.params[n]
            if _is_dtensor(p):
                from torch.distributed.tensor import DTensor

                # pinned slot buffers: the copies to the accelerator are queued, the gathers wait on them in stream
                sent = local.to(_comm_device(p), non_blocking=True)
                full = DTensor.from_local(
                    sent, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                ).full_tensor()
                # Always a copy: when no rank needs to send anything (a mesh of one shard group on CPU) the gather
                # hands back the slot's own buffer, which the next swap_out overwrites in place.
                if not to_cpu:
                    shared = full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                    out[self._keys[n]] = full.detach().clone() if shared else full.detach()
                else:
                    out[self._keys[n]] = full.detach().to("cpu", copy=True)
            elif to_cpu:
                out[self._keys[n]] = local.detach().clone()
            else:
                out[self._keys[n]] = local.detach().to(_local(p).device, copy=True, non_blocking=True)
        if not to_cpu:
            _wait_for_copies()  # the slot's host buffers may be written again once this returns
        return out

    def set_adapter_state(self, slot: int, state: Mapping[str, torch.Tensor], *, reset_optimizer: bool = False) -> None:
        """Overwrite slot ``slot`` with a full PEFT adapter state dict; bumps the slot's version.

        Keys must match the bank's exactly and shapes must be the global parameter shapes; values are cast to the
        parameter dtype. Every rank must pass the same tensors (each keeps its own shard). Each rank's share is cut
        where the state lives and copied into the slot's buffer without waiting per tensor: a child made on the
        accelerator crosses to the host as this rank's shard only, and the write waits once at the end.
        """
        self._check_slot(slot)
        self._validate_state(state, f"slot {slot}")
        if self._active == slot:
            self.swap_out()
        s = self._slots[slot]
        with torch.no_grad():
            for n, p in self._params.items():
                full = state[self._keys[n]].detach().to(dtype=p.dtype)
                s.params[n] = self._into(s.params.get(n), shard_like(full, p), non_blocking=True)
            _wait_for_copies()  # the slot's buffers are read next (a swap, a gather, a save)
        s.version += 1
        if reset_optimizer:
            s.optim, s.scheduler, s.lrs = None, None, None
        if self._active == slot:
            # The live adapter holds the old weights: force a reload on next use.
            self._active, self._dirty = None, False

    def _validate_state(self, state: Mapping[str, torch.Tensor], what: str) -> None:
        validate_adapter_state(state, {k: tuple(self._params[n].shape) for k, n in self._by_key.items()}, what)

    def apply_plan(
        self,
        entries: Sequence[PlanEntry | Mapping[str, Any]],
        operators: Mapping[str, Any] | None = None,
        *,
        timing: dict[str, float] | None = None,
    ) -> list[int]:
        """Write evolution children into their slots; returns the child slots (:func:`apply_evolution_plan`)."""
        return apply_evolution_plan(self, entries, operators, timing=timing)

    def shard_checksums(self) -> dict[int, str]:
        """Per slot, a short hash of **this rank's** shards (no collective): which slots changed on which rank."""
        import hashlib

        self.swap_out()
        out = {}
        for k, s in enumerate(self._slots):
            h = hashlib.sha1()
            for n in sorted(s.params):
                t = s.params[n].detach().contiguous()
                h.update(n.encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            out[k] = h.hexdigest()[:12]
        return out

    # --- persistence -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the bank on this rank (local shards; save one file per rank)."""
        self.swap_out()
        return {
            "format_version": BANK_FORMAT_VERSION,
            "adapter_name": self.adapter_name,
            "param_names": list(self._params),
            "local_shapes": {n: list(_local(p).shape) for n, p in self._params.items()},
            "slots": [dataclasses.asdict(s) for s in self._slots],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_saved_bank(state, {n: tuple(_local(p).shape) for n, p in self._params.items()})
        slots = []
        for raw in state["slots"]:
            params = {n: self._cpu_copy(t) for n, t in raw["params"].items()}
            optim = None
            if raw.get("optim"):
                optim = {
                    n: {k: (self._cpu_copy(v) if torch.is_tensor(v) else v) for k, v in st.items()}
                    for n, st in raw["optim"].items()
                }
            slots.append(
                _Slot(
                    params=params,
                    optim=optim,
                    scheduler=copy.deepcopy(raw.get("scheduler")),
                    lrs=copy.deepcopy(raw.get("lrs")),
                    version=int(raw.get("version", 0)),
                    updates=int(raw.get("updates", 0)),
                )
            )
        self._slots = slots
        self._active, self._dirty = None, False

    def save(self, path: str) -> None:
        """``torch.save`` the bank (this rank's shards) to ``path``, atomically."""
        save_atomically(self.state_dict(), path)

    def load(self, path: str) -> None:
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


def validate_adapter_state(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """A full PEFT adapter state dict must have exactly ``shapes``' keys, those shapes and finite values."""
    if not isinstance(state, Mapping):
        raise AdapterBankError(f"{what}: adapter state must be a mapping of PEFT keys to tensors")
    keys, expected = set(state), set(shapes)
    if keys != expected:
        missing, extra = sorted(expected - keys), sorted(keys - expected)
        raise AdapterBankError(f"{what}: adapter keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in state.items():
        if not torch.is_tensor(v):
            raise AdapterBankError(f"{what}: {k} is {type(v).__name__}, not a tensor")
        if tuple(v.shape) != tuple(shapes[k]):
            raise AdapterBankError(f"{what}: {k} has shape {tuple(v.shape)}, expected {tuple(shapes[k])}")
    # one answer per device, not one per tensor: on an accelerator each answer waits for the device
    by_device: dict[torch.device, list[str]] = {}
    for k, v in state.items():
        by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        finite = torch.stack([torch.isfinite(state[k]).all() for k in keys]).tolist()
        bad = [k for k, ok in zip(keys, finite) if not ok]
        if bad:
            raise AdapterBankError(f"{what}: {bad[0]} has non-finite values")


def check_saved_bank(state: Mapping[str, Any], local_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A saved bank (either layout) fits this rank: format, adapter parameters and this rank's shard shapes."""
    if state.get("format_version") != BANK_FORMAT_VERSION:
        raise AdapterBankError(f"bank format {state.get('format_version')!r} != {BANK_FORMAT_VERSION}")
    if list(state.get("param_names", [])) != list(local_shapes):
        raise AdapterBankError("saved bank was made for different adapter parameters (model or LoRA config changed)")
    for n, shape in local_shapes.items():
        if list(state["local_shapes"][n]) != list(shape):
            raise AdapterBankError(
                f"saved shard of {n} has shape {state['local_shapes'][n]}, this rank holds {list(shape)}"
                " (world size or sharding changed)"
            )


def save_atomically(state: Mapping[str, Any], path: str) -> None:
    """``torch.save`` to ``path`` through a temporary file, so a crash never leaves half a file under its name."""
    import os

    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def default_lora_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """PEFT's default LoRA init of one parameter: ``lora_A`` Kaiming-uniform (bound ``1/sqrt(fan_in)``), ``lora_B``
    zero."""
    is_b = ".lora_B." in name or ".lora_embedding_B." in name
    if is_b or len(shape) != 2:
        return torch.zeros(shape)
    fan_in = shape[1]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), as PEFT initialises lora_A
    return torch.rand(shape, generator=gen) * (2 * bound) - bound


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` laid out like ``like`` (no communication: ``full`` is on every rank)."""
    if not _is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    sharded = distribute_tensor(full.to(_comm_device(like)), like.device_mesh, like.placements, src_data_rank=None)
    return sharded.to_local()


def apply_evolution_plan(
    store: Any,
    entries: Sequence[PlanEntry | Mapping[str, Any]],
    operators: Mapping[str, Any] | None = None,
    *,
    timing: dict[str, float] | None = None,
) -> list[int]:
    """Write evolution children into the slots of ``store`` (a bank or resident adapters); returns the child slots.

    Every child is computed from the parents' weights **before** any child is written, so a slot that is both a
    parent and (later in the plan) a victim gives its pre-plan weights. ``operators`` defaults to
    ``populora_verl.evolution.operators.OPERATORS``.

    The parents are read where the slots live (``get_adapter_state(slot, to_cpu=False)``: on the accelerator under
    FSDP2, a gather of their LoRA tensors only) and the operators run there; a child is written as soon as no later
    entry reads its slot, and each parent is dropped once no later entry needs it. Noise is drawn from a CPU
    generator seeded by the entry, as the CPU driver draws it, so both engines make the same child up to rounding.

    ``timing``, when given, receives the seconds of each phase (:data:`EVOLUTION_PHASES`): ``gather`` (reading the
    parents), ``operator``, ``scatter`` (each child into its slot: this rank's share) and ``optimizer`` (a fresh
    optimizer, or a copy of the first parent's). Each phase waits for the accelerator before it ends, so its seconds
    include the work it queued.
    """
    if operators is None:
        from populora_verl.evolution.operators import OPERATORS as operators  # noqa: N811
    plan = [PlanEntry.coerce(e) for e in entries]
    children = [e.child_slot for e in plan]
    if len(set(children)) != len(children):
        raise AdapterBankError(f"plan writes a slot twice: {children}")
    for e in plan:  # the whole plan is checked before any slot is read or written
        store._check_slot(e.child_slot)
        if e.operator not in operators:
            raise AdapterBankError(f"unknown operator {e.operator!r} (known: {sorted(operators)})")
        want = getattr(operators[e.operator], "num_parents", len(e.parent_slots))
        if len(e.parent_slots) != want:
            raise AdapterBankError(f"operator {e.operator} needs {want} parents, got {list(e.parent_slots)}")
        for ps in e.parent_slots:
            store._check_slot(ps)
    split = dict.fromkeys(EVOLUTION_PHASES, 0.0)
    cache: dict[int, dict[str, torch.Tensor]] = {}
    deferred: list[tuple[PlanEntry, dict[str, torch.Tensor]]] = []
    with torch.no_grad():
        for i, e in enumerate(plan):
            later = {ps for f in plan[i + 1 :] for ps in f.parent_slots}
            with timed_phase(split, "gather"):
                for ps in e.parent_slots:
                    if ps not in cache:
                        cache[ps] = store.get_adapter_state(ps, to_cpu=False)
            with timed_phase(split, "operator"):
                gen = torch.Generator().manual_seed(e.seed)
                child = operators[e.operator]([cache[ps] for ps in e.parent_slots], generator=gen, **dict(e.params))
            for ps in [ps for ps in cache if ps not in later]:
                del cache[ps]
            if e.child_slot in later:
                deferred.append((e, child))  # a later entry still reads this slot's pre-plan weights
            else:
                _write_child(store, e, child, split)
            del child
        for e, child in deferred:
            _write_child(store, e, child, split)
    if timing is not None:
        timing.update(split)
    return children


@contextlib.contextmanager
def timed_phase(split: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds of the block to ``split[name]``, the accelerator's queued work included."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _wait_for_copies()
        split[name] = split.get(name, 0.0) + time.perf_counter() - t0


def _write_child(store: Any, e: PlanEntry, child: Mapping[str, torch.Tensor], split: dict[str, float]) -> None:
    # A child that keeps an optimizer state keeps its fitter parent's (as the CPU driver), not its victim's.
    # Parents are survivors, never children of this plan, so their state is still the pre-plan one.
    with timed_phase(split, "scatter"):
        store.set_adapter_state(e.child_slot, child)
    with timed_phase(split, "optimizer"):
        if e.reset_optimizer:
            store.reset_optimizer(e.child_slot)
        else:
            store.copy_optimizer(int(e.parent_slots[0]), e.child_slot)


def bank_filename(world_size: int, rank: int) -> str:
    """Per-rank bank file name, next to verl's ``model_world_size_{W}_rank_{r}.pt`` naming."""
    return f"bank_world_size_{world_size}_rank_{rank}.pt"


def bank_file_for(directory: str, world_size: int, rank: int) -> str:
    """The bank file this rank resumes from; a one-line :class:`AdapterBankError` if it is not there.

    Each file holds one rank's shards and optimizer state, so a bank saved at another world size cannot be loaded
    (the shards would not line up). The message says which world sizes the folder holds and what to do.
    """
    import os
    import re

    path = os.path.join(directory, bank_filename(world_size, rank))
    if os.path.exists(path):
        return path
    names = os.listdir(directory) if os.path.isdir(directory) else []
    saved = sorted({int(m.group(1)) for n in names if (m := re.fullmatch(r"bank_world_size_(\d+)_rank_\d+\.pt", n))})
    if saved and world_size not in saved:
        raise AdapterBankError(
            f"adapter bank in {directory} was saved by {', '.join(map(str, saved))} rank(s) but this run has "
            f"{world_size}: resume with the same trainer.n_gpus_per_node x trainer.nnodes, or start a new run (the "
            "full per-member PEFT adapters stay readable in the checkpoint's populora/population/adapters/)"
        )
    raise AdapterBankError(f"no adapter bank for world size {world_size}, rank {rank} at {path}")
