"""Resident adapters: every slot's LoRA weights live in the model, and one forward and backward train them all.

The adapter bank (:mod:`populora_verl.workers.adapter_bank`) time-shares one live PEFT adapter: a swap, a forward and
backward, an optimizer step and a weight sync per slot. Here every slot stays in the model instead:

* **Layout.** Each PEFT LoRA linear keeps its base layer and gets, per slot ``k``, a plain ``lora_slots_A[k]``
  (``r x in``) and ``lora_slots_B[k]`` (``out x r``) parameter, replicated on every data-parallel rank (LoRA weights
  are a few percent of the model; their gradients are averaged once per step with one flat all-reduce). They are
  not registered with the module, so FSDP, verl's checkpoints and its base-weight sync never see them. PEFT's own
  ``"default"`` adapter stays in the model, switched off, so verl's PEFT-aware helpers (the base-weight sync, the
  reference policy) keep working.
* **Routing.** A micro-batch's tokens are tagged with their slot (:class:`SlotRouting`, built from each row's slot and
  length). Every LoRA linear adds ``scale * B_k (A_k x)`` for the tokens of slot ``k``: with ``torch._grouped_mm`` over
  the slot-sorted tokens where the GPU has it, a per-slot loop otherwise (both are the same formula). Tokens whose
  rows are grouped by slot, in any slot order (the trainer lays rows out that way), are not permuted; one slot
  alone takes the bank's single ``addmm``. The present slots' weights enter as one stacked cast per linear, and
  their gradients leave as one multi-tensor add (:func:`slot_weights`).
* **Training.** The loss is summed over slots, each slot's part normalised by its own tokens
  (:func:`slot_token_mean`), so slot ``k``'s gradient is the gradient it would get alone. One optimizer holds one
  parameter group per slot; :meth:`ResidentAdapters.optimizer_step` clips each slot by its own gradient norm, skips
  slots that had no rows (their gradients are dropped, so AdamW neither decays nor counts a step for them) and sets
  each slot's learning rate from its own schedule position (:meth:`ResidentAdapters.advance_schedule` moves it).

:class:`ResidentAdapters` keeps the bank's interface (slots, versions, full PEFT state dicts, evolution plans,
optimizer reset and copy, checksums) and writes the bank's file format, so a run saved by either layout resumes in
the other. Pure torch + PEFT naming; no verl import.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import torch

from populora_verl.workers.adapter_bank import (
    BANK_FORMAT_VERSION,
    AdapterBankError,
    _comm_device,
    _is_dtensor,
    _local,
    apply_evolution_plan,
    check_saved_bank,
    default_lora_init,
    peft_key,
    save_atomically,
    shard_like,
    validate_adapter_state,
)

__all__ = [
    "ResidentAdapters",
    "SlotRouting",
    "routing",
    "current_routing",
    "lora_add",
    "lora_delta",
    "slot_weights",
    "slot_token_mean",
    "grouped_mm_available",
    "LAYOUTS",
]

#: ``populora.population.adapter_layout`` values: ``bank`` (one live adapter swapped per slot) or ``resident``.
LAYOUTS = ("bank", "resident")

#: the parameter lists added to each LoRA linear; the ``lora_`` in the name keeps them out of verl's base-weight sync
SLOT_A, SLOT_B = "lora_slots_A", "lora_slots_B"


# --- routing -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotRouting:
    """Which slot each token of a forward belongs to (tokens flattened over batch and sequence).

    ``counts[k]`` tokens of slot ``k``; ``present`` the slots with tokens, in the order the kernels take them. When
    each slot's tokens already form one contiguous run (rows grouped by slot, in any slot order: the fused call's
    layout, which verl's micro-batching keeps), ``present`` is the runs' order and ``perm`` is ``None``: no token is
    moved. Otherwise ``perm`` gathers the tokens slot by slot (``present`` ascending) and ``inverse`` puts them back.
    Built once per micro-batch; every LoRA linear reuses it.
    """

    num_slots: int
    num_tokens: int
    counts: tuple[int, ...]
    perm: torch.Tensor | None
    inverse: torch.Tensor | None
    present: tuple[int, ...]  # slots with at least one token, in kernel order
    offsets: torch.Tensor  # int32 cumulative ends of the present slots' tokens, on the tokens' device (``offs``)

    @classmethod
    def from_tokens(cls, token_slots: torch.Tensor, num_slots: int) -> SlotRouting:
        token_slots = token_slots.reshape(-1).long()
        n = int(token_slots.numel())
        if n and (int(token_slots.min()) < 0 or int(token_slots.max()) >= num_slots):
            raise AdapterBankError(f"token slots outside 0..{num_slots - 1}: {sorted(set(token_slots.tolist()))[:8]}")
        if n:
            starts = torch.ones(n, dtype=torch.bool, device=token_slots.device)
            starts[1:] = token_slots[1:] != token_slots[:-1]
            run_slots = token_slots[starts].tolist()
            run_ends = torch.cat([starts.nonzero().flatten()[1:], starts.new_tensor([n], dtype=torch.long)]).tolist()
            if len(set(run_slots)) == len(run_slots):  # each slot one run: no permutation
                return cls._contiguous(num_slots, run_slots, run_ends, token_slots.device)
        counts = torch.bincount(token_slots, minlength=num_slots)
        perm = torch.argsort(token_slots, stable=True)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(n, device=perm.device)
        present = counts > 0
        offsets = torch.cumsum(counts[present], 0).to(torch.int32)
        return cls(
            num_slots=num_slots,
            num_tokens=n,
            counts=tuple(int(c) for c in counts.tolist()),
            perm=perm,
            inverse=inverse,
            present=tuple(int(k) for k in present.nonzero().flatten().tolist()),
            offsets=offsets,
        )

    @classmethod
    def _contiguous(
        cls, num_slots: int, run_slots: Sequence[int], run_ends: Sequence[int], device: torch.device | str | None
    ) -> SlotRouting:
        counts = [0] * num_slots
        start = 0
        for k, end in zip(run_slots, run_ends, strict=True):
            counts[k] = end - start
            start = end
        return cls(
            num_slots=num_slots,
            num_tokens=start,
            counts=tuple(counts),
            perm=None,
            inverse=None,
            present=tuple(run_slots),
            offsets=torch.tensor(list(run_ends), dtype=torch.int32, device=device),
        )

    @classmethod
    def from_rows(
        cls,
        row_slots: torch.Tensor | Sequence[int],
        row_lengths: torch.Tensor | Sequence[int],
        num_slots: int,
        device: torch.device | str | None = None,
    ) -> SlotRouting:
        """Routing for rows packed one after another (verl's remove-padding layout), or padded rows of one length.

        Rows grouped by slot are routed from the row lists alone (no token-level tensor, no device round trip);
        only rows interleaved across slots build the per-token permutation on ``device``."""
        slots = torch.as_tensor(row_slots, dtype=torch.long).reshape(-1).tolist()
        lengths = torch.as_tensor(row_lengths, dtype=torch.long).reshape(-1).tolist()
        if len(slots) != len(lengths):
            raise AdapterBankError(f"{len(slots)} row slots for {len(lengths)} row lengths")
        if slots and (min(slots) < 0 or max(slots) >= num_slots):
            raise AdapterBankError(f"token slots outside 0..{num_slots - 1}: {sorted(set(slots))[:8]}")
        run_slots: list[int] = []
        run_ends: list[int] = []
        end = 0
        for k, length in zip(slots, lengths, strict=True):
            if length <= 0:
                continue
            end += length
            if run_slots and run_slots[-1] == k:
                run_ends[-1] = end
            else:
                run_slots.append(k)
                run_ends.append(end)
        if len(set(run_slots)) == len(run_slots):
            return cls._contiguous(num_slots, run_slots, run_ends, device)
        return cls.from_tokens(
            torch.repeat_interleave(
                torch.tensor(slots, dtype=torch.long, device=device),
                torch.tensor(lengths, dtype=torch.long, device=device),
            ),
            num_slots,
        )


class _Current:
    routing: SlotRouting | None = None
    base_only: bool = False


_CURRENT = _Current()


def current_routing() -> SlotRouting | None:
    return None if _CURRENT.base_only else _CURRENT.routing


def set_routing(r: SlotRouting | None) -> None:
    """Route the following forwards (and the recomputation of gradient checkpointing in their backward) by ``r``."""
    _CURRENT.routing = r


@contextlib.contextmanager
def routing(r: SlotRouting | None) -> Iterator[SlotRouting | None]:
    """``with routing(r):`` forwards inside add each slot's LoRA to its own tokens."""
    prev = _CURRENT.routing
    _CURRENT.routing = r
    try:
        yield r
    finally:
        _CURRENT.routing = prev


@contextlib.contextmanager
def base_only() -> Iterator[None]:
    """Forwards inside run the base model alone (the reference policy of a LoRA actor)."""
    prev = _CURRENT.base_only
    _CURRENT.base_only = True
    try:
        yield
    finally:
        _CURRENT.base_only = prev


# --- the LoRA delta ------------------------------------------------------------------------------------------------


def grouped_mm_available(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs bf16 on CUDA GPUs of compute capability 9.0 and newer."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def _grouped_fits(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes this linear: every operand it sees, forward and backward, is a 2-D
    ``(tokens, in)``, ``(tokens, r)`` or ``(tokens, out)`` matrix whose row stride must be a multiple of 16 bytes, so
    the input, rank and output widths must be (a rank-4 bf16 adapter is not); ``a`` is ``(slots, r, in)`` and ``b``
    ``(slots, out, r)``."""
    align = 16 // x.element_size()
    return all(d % align == 0 for d in (a.shape[-1], a.shape[-2], b.shape[-2]))


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) in a layout torch's grouped matmul takes: unit stride along a row, a row stride that covers the
    row and is a multiple of 16 bytes, and data at a 16-byte aligned address (CUDA refuses misaligned data; the CPU
    does not check). A tensor already so is returned as is; anything else (a strided or offset view of a wider
    activation, an expanded or transposed gradient) is copied once into a fresh contiguous one."""
    align = 16 // t.element_size()
    rows_ok = t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.stride(0) % align == 0
    if rows_ok and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _SlotWeights(torch.autograd.Function):
    """The present slots' ``A`` and ``B`` weights, each set stacked and cast to the compute dtype: two kernels per
    set whatever the number of slots, where a cast per slot would launch one each (and another in backward).

    Backward casts each stacked gradient back once and adds it into the slots' ``.grad`` with one multi-tensor add
    (a slot without one yet takes its view), returning no gradient to autograd: its per-slot cast and accumulation
    would launch four kernels per slot and LoRA linear, in every micro-batch. Megatron's gradient-accumulation
    fusion does the same for its weights. The slot parameters carry no hooks (they are not FSDP's), so nothing that
    autograd's accumulation would run is skipped."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, n_a: int, *weights: torch.Tensor):
        ctx.weights = weights
        ctx.n_a = n_a
        a = _stack_cast(weights[:n_a], dtype)
        b = _stack_cast(weights[n_a:], dtype)
        return a, b

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor | None, grad_b: torch.Tensor | None):
        weights = ctx.weights
        parts = []
        for grad, ws in ((grad_a, weights[: ctx.n_a]), (grad_b, weights[ctx.n_a :])):
            if grad is None or not ws:
                continue
            grad = grad.to(ws[0].dtype, copy=True)  # a buffer of its own: the slots' .grad become views of it
            parts += [(w, g) for w, g in zip(ws, grad.unbind(0), strict=True) if w.requires_grad]
        have = [(w, g) for w, g in parts if w.grad is not None]
        if have:
            torch._foreach_add_([w.grad for w, _ in have], [g for _, g in have])
        for w, g in parts:
            if w.grad is None:
                w.grad = g
        ctx.weights = None
        return (None, None) + (None,) * len(weights)


def _stack_cast(ws: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if len(ws) == 1:  # one kernel: the cast (or, at the same dtype, a copy: an output must not alias an input)
        return ws[0].to(dtype, copy=True).unsqueeze(0)
    return torch.stack(list(ws)).to(dtype)


def slot_weights(
    r: SlotRouting, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of the slots present in ``r``, in its kernel order: ``(present, r, in)`` and ``(present, out, r)``
    in ``dtype``. Only these slots enter the graph: an absent slot's weights cost nothing in this micro-batch, and a
    slot parameter (a plain tensor, not FSDP's) that saw no token on a rank simply has no gradient there
    (:meth:`ResidentAdapters.optimizer_step`)."""
    ws = [lora_a[k] for k in r.present] + [lora_b[k] for k in r.present]
    if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
        return _SlotWeights.apply(dtype, len(r.present), *ws)
    return _stack_cast(ws[: len(r.present)], dtype), _stack_cast(ws[len(r.present) :], dtype)


def lora_add(
    output: torch.Tensor,
    x: torch.Tensor,
    r: SlotRouting,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scaling: float,
    *,
    grouped: bool | None = None,
) -> torch.Tensor:
    """``output`` plus ``scaling * B_k (A_k x_t)`` on the row of every routed token ``t`` of slot ``k``.

    ``x`` is ``(tokens, in)`` and ``output`` ``(tokens, out)``; rows past ``r.num_tokens`` (a packed sequence's
    alignment pad) keep ``output``. The sum is written in as few activation-sized passes as the case allows, since
    at a micro-batch of 16k tokens each such pass costs more than the LoRA matmuls themselves:

    * one slot: ``addmm(output, x A^T, B^T, alpha=scaling)``, the bank's lean forward (one pass);
    * tokens grouped by slot: the two grouped (or per-slot) matmuls, the scaling on the rank-wide ``x A^T``, one
      add; on the loop kernel one ``addmm`` per slot's rows;
    * tokens interleaved: ``x`` gathered slot by slot, and the result scattered back onto ``output`` by one
      ``index_add``.
    """
    n = r.num_tokens
    if x.shape[0] < n or output.shape[0] != x.shape[0]:
        raise AdapterBankError(f"a LoRA linear got {x.shape[0]} tokens but the routing has {n}")
    present = r.present
    if not present:
        return output
    if output.dtype != x.dtype:  # no shared dtype for one fused kernel: the delta in x's dtype, then output's
        return output + lora_add(
            torch.zeros_like(output, dtype=x.dtype), x, r, lora_a, lora_b, scaling, grouped=grouped
        ).to(output.dtype)
    tail = output[n:] if x.shape[0] > n else None
    if tail is not None:  # slicing only when there is a pad: a slice's backward writes a full-size zero gradient
        x, output = x[:n], output[:n]
    a, b = slot_weights(r, lora_a, lora_b, x.dtype)
    perm = None if r.perm is None else r.perm.to(x.device)
    if perm is None and len(present) == 1:
        out = torch.addmm(output, x @ a.squeeze(0).t(), b.squeeze(0).t(), alpha=scaling)
    else:
        xs = x if perm is None else x.index_select(0, perm)
        if grouped is None:
            grouped = grouped_mm_available(xs) and _grouped_fits(xs, a, b)
        if grouped:
            offs = r.offsets.to(xs.device)
            # the layer's input is taken as it comes (no gather when rows are grouped by slot): a view the kernel
            # refuses is copied first
            h = torch._grouped_mm(_kernel_operand(xs), a.transpose(1, 2), offs=offs) * scaling
            y = torch._grouped_mm(h, b.transpose(1, 2), offs=offs)
            if y.requires_grad:
                # y's gradient is the layer output's, as the layer above made it (added to output, nothing
                # reshapes it), and it enters the kernel's backward as an operand
                y.register_hook(_kernel_operand)
            out = output + y if perm is None else output.index_add(0, perm, y)
        else:
            sizes = [r.counts[k] for k in present]
            # split and unbind, not slicing or indexing: their backward is one concatenation or stack, where each
            # slice's would write a full-size zero gradient
            aw, bw = a.unbind(0), b.unbind(0)
            hs = [seg @ aw[j].t() for j, seg in enumerate(xs.split(sizes))]
            if perm is None:
                out = torch.cat(
                    [
                        torch.addmm(o, h, bw[j].t(), alpha=scaling)
                        for j, (o, h) in enumerate(zip(output.split(sizes), hs, strict=True))
                    ]
                )
            else:
                y = torch.cat([h @ bw[j].t() for j, h in enumerate(hs)])
                out = output.index_add(0, perm, y, alpha=scaling)
    return out if tail is None else torch.cat([out, tail])


def lora_delta(
    x: torch.Tensor,
    r: SlotRouting,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scaling: float,
    *,
    grouped: bool | None = None,
) -> torch.Tensor:
    """``scaling * B_k (A_k x_t)`` for every token ``t`` of slot ``k``; ``x`` is ``(tokens, in)``. The delta alone
    (tests and benchmarks); the model adds it with :func:`lora_add`."""
    if x.shape[0] != r.num_tokens:
        raise AdapterBankError(f"a LoRA linear got {x.shape[0]} tokens but the routing has {r.num_tokens}")
    zero = x.new_zeros(x.shape[0], lora_b[0].shape[0])
    return lora_add(zero, x, r, lora_a, lora_b, scaling, grouped=grouped)


def _resident_hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    r = current_routing()
    if r is None:
        return output
    x = args[0]
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] < r.num_tokens:
        raise AdapterBankError(f"a LoRA linear got {flat.shape[0]} tokens but the routing has {r.num_tokens}")
    out = lora_add(
        output.reshape(-1, output.shape[-1]),
        flat,
        r,
        module.lora_slots_A,
        module.lora_slots_B,
        module.lora_slots_scaling,
    )
    return out.view(output.shape)


# --- the loss ------------------------------------------------------------------------------------------------------


def slot_token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, row_slots: torch.Tensor, slot_tokens: Mapping[int, float]
) -> torch.Tensor:
    """Sum over slots of each slot's token-mean loss: ``sum_k sum_{t in k} l_t / T_k``.

    ``loss_mat``/``mask`` are ``(rows, tokens)``; ``slot_tokens[k]`` is slot k's token count over the whole
    mini-batch (all micro-batches and ranks), so micro-batch losses add up to the per-slot means. A slot's parameters
    see only their own rows, hence exactly their own token-mean gradient.
    """
    # one lookup for every slot (not a pass over the rows per slot); a row of a slot without a count keeps 1
    keys = torch.tensor([int(k) for k in slot_tokens], dtype=torch.long, device=row_slots.device)
    vals = torch.tensor(
        [max(float(t), 1.0) for t in slot_tokens.values()], dtype=loss_mat.dtype, device=row_slots.device
    )
    match = row_slots.reshape(-1, 1) == keys.reshape(1, -1)
    denom = torch.where(
        match.any(-1), (match * vals).sum(-1), torch.ones((), dtype=loss_mat.dtype, device=row_slots.device)
    )
    return ((loss_mat * mask).sum(-1) / denom.to(loss_mat.device)).sum()


# --- the slots -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _SlotMeta:
    version: int = 0  # bumped whenever the weights change other than by training
    updates: int = 0  # optimizer steps taken (training calls that had rows of the slot)
    schedule_step: int = 0  # position in the LR schedule (the bank: its scheduler's last_epoch)


def _is_lora_layer(module: torch.nn.Module, adapter_name: str) -> bool:
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    return (
        isinstance(a, torch.nn.ModuleDict)
        and isinstance(b, torch.nn.ModuleDict)
        and adapter_name in a
        and hasattr(module, "base_layer")
    )


class ResidentAdapters:
    """N LoRA adapters resident in one PEFT model, each with its own optimizer group, clip and LR schedule.

    Args:
        model: the PEFT model (possibly FSDP2-sharded) with one ``"default"`` LoRA adapter on its linears.
        optimizer: the engine's optimizer: its class and defaults build the per-slot optimizer (``None``: forward
            only). It must own no parameter that :meth:`optimizer_step` should still step: the resident optimizer
            replaces it.
        lr_scheduler: the engine's ``LambdaLR`` (verl's constant and cosine schedules): each slot follows its lambda
            from its own position. ``None``: constant LR.
    """

    layout = "resident"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        *,
        adapter_name: str = "default",
    ) -> None:
        self.model = model
        self.adapter_name = adapter_name
        self._layers: dict[str, torch.nn.Module] = {
            n: m for n, m in model.named_modules() if _is_lora_layer(m, adapter_name)
        }
        if not self._layers:
            raise AdapterBankError(f"model has no LoRA linear layers of adapter {adapter_name!r}")
        # bank parameter names (the "default" adapter's, in model order) -> (layer, "A" | "B")
        self._params: dict[str, tuple[str, str]] = {}
        self._default: dict[str, torch.nn.Parameter] = {}
        for name, p in model.named_parameters():
            for lname in self._layers:
                for which in ("A", "B"):
                    if name.startswith(f"{lname}.lora_{which}.{adapter_name}."):
                        self._params[name] = (lname, which)
                        self._default[name] = p
        for name in list(self._params):
            if not name.endswith(".weight"):
                raise AdapterBankError(f"resident adapters support plain LoRA linears only, found {name}")
        self._keys = {n: peft_key(n, adapter_name) for n in self._params}
        self._by_key = {k: n for n, k in self._keys.items()}
        self._opt_cls = type(optimizer) if optimizer is not None else None
        self._opt_defaults = dict(optimizer.defaults) if optimizer is not None else None
        self._lambda, self._base_lr, self._sched_template = self._schedule_of(lr_scheduler, optimizer)
        self.optimizer: torch.optim.Optimizer | None = None
        self._meta: list[_SlotMeta] = []
        self._stepped: set[int] = set()
        self._hooks: list[Any] = []
        self._reduce_group: Any = None

    # --- set-up --------------------------------------------------------------------------------------------------

    @staticmethod
    def _schedule_of(sched: Any, optimizer: Any) -> tuple[Callable[[int], float] | None, float | None, Any]:
        if optimizer is None:
            return None, None, None
        if sched is None:
            return None, float(optimizer.defaults["lr"]), None
        lambdas = getattr(sched, "lr_lambdas", None)
        if not lambdas or not callable(lambdas[0]):
            raise AdapterBankError(f"resident adapters follow a LambdaLR schedule per slot, got {type(sched).__name__}")
        return lambdas[0], float(sched.base_lrs[0]), copy.deepcopy(sched.state_dict())

    def _layer_shape(self, lname: str, which: str) -> tuple[int, int]:
        return tuple(getattr(self._layers[lname], f"lora_{which}")[self.adapter_name].weight.shape)

    def _allocate(self, num_slots: int) -> None:
        """(Re)create every layer's slot parameters, switch PEFT's own adapter off and build the optimizer."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for lname, layer in self._layers.items():
            wa = layer.lora_A[self.adapter_name].weight
            # on the accelerator even when verl offloads the (sharded) base parameters to the host between calls
            device, dtype = _slot_device(_local(wa).device), wa.dtype
            shapes = {"A": self._layer_shape(lname, "A"), "B": self._layer_shape(lname, "B")}
            for which, attr in (("A", SLOT_A), ("B", SLOT_B)):
                # a plain list, not registered with the module: verl's FSDP wrapping, checkpoints, offload and
                # base-weight sync never see the slots; they live in the resident files (the bank's format)
                setattr(
                    layer,
                    attr,
                    [
                        torch.nn.Parameter(torch.zeros(shapes[which], device=device, dtype=dtype))
                        for _ in range(num_slots)
                    ],
                )
            layer.lora_slots_scaling = float(layer.scaling[self.adapter_name])
            # PEFT's forward then runs the base layer alone; the hook adds the routed slots
            layer._disable_adapters = True
            for p in (layer.lora_A[self.adapter_name].weight, layer.lora_B[self.adapter_name].weight):
                p.requires_grad_(False)
            self._hooks.append(layer.register_forward_hook(_resident_hook))
        self._meta = [_SlotMeta() for _ in range(num_slots)]
        self._stepped: set[int] = set()
        self.optimizer = None
        if self._opt_cls is not None:
            groups = [{"params": self.slot_parameters(k), "lr": self._lr_at(0)} for k in range(num_slots)]
            # the template's hyperparameters that its constructor takes (defaults also holds derived ones)
            accepted = inspect.signature(self._opt_cls.__init__).parameters
            kwargs = {k: v for k, v in self._opt_defaults.items() if k in accepted and k != "lr"}
            self.optimizer = self._opt_cls(groups, lr=self._lr_at(0), **kwargs)

    def _slot_param(self, slot: int, name: str) -> torch.nn.Parameter:
        lname, which = self._params[name]
        return getattr(self._layers[lname], SLOT_A if which == "A" else SLOT_B)[slot]

    def slot_parameters(self, slot: int) -> list[torch.nn.Parameter]:
        """Slot ``slot``'s parameters in the bank's parameter order."""
        return [self._slot_param(slot, n) for n in self._params]

    def set_reduce_group(self, group: Any) -> None:
        """Average slot gradients over this process group before each optimizer step (the data-parallel group)."""
        self._reduce_group = group

    # --- introspection -------------------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self._meta)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(self._meta):
            raise AdapterBankError(f"slot {slot!r} out of range: the model holds {len(self._meta)} resident slots")

    def version(self, slot: int) -> int:
        self._check_slot(slot)
        return self._meta[slot].version

    def slot_info(self, slot: int) -> dict[str, int]:
        self._check_slot(slot)
        m = self._meta[slot]
        return {"version": m.version, "updates": m.updates, "optimizer_step": self._optimizer_step(slot)}

    def _optimizer_step(self, slot: int) -> int:
        if self.optimizer is None:
            return 0
        steps = [
            float(st["step"]) for p in self.slot_parameters(slot) if "step" in (st := self.optimizer.state.get(p, {}))
        ]
        return int(max(steps)) if steps else 0

    # --- slots ---------------------------------------------------------------------------------------------------

    def init_slots(
        self, num_slots: int, seed: int | None = None, *, from_live: bool = False, shared_a: bool = False
    ) -> None:
        """Create ``num_slots`` resident slots with fresh optimizer state; the same draws as the bank's."""
        if not isinstance(num_slots, int) or num_slots < 1:
            raise AdapterBankError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        if not from_live and seed is None:
            raise AdapterBankError("init_slots needs a seed unless from_live=True")
        self._allocate(num_slots)
        with torch.no_grad():
            for k in range(num_slots):
                gen = (
                    None if from_live else torch.Generator().manual_seed(int(seed) * 1_000_003 + (0 if shared_a else k))
                )
                for n, p in self._default.items():
                    if from_live:
                        full = _full(p)
                    else:
                        full = default_lora_init(n, tuple(p.shape), gen).to(p.dtype)
                    self._slot_param(k, n).copy_(full)

    def get_adapter_state(self, slot: int, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """Slot ``slot`` as a PEFT adapter state dict of full tensors (no collective: slots are replicated), on the
        CPU, or with ``to_cpu=False`` copies where the slot lives (evolution's operators run there)."""
        self._check_slot(slot)
        device = "cpu" if to_cpu else None
        return {self._keys[n]: self._slot_param(slot, n).detach().to(device=device, copy=True) for n in self._params}

    def set_adapter_state(self, slot: int, state: Mapping[str, torch.Tensor], *, reset_optimizer: bool = False) -> None:
        """Overwrite slot ``slot`` with a full PEFT adapter state dict; bumps the slot's version."""
        self._check_slot(slot)
        self._validate_state(state, f"slot {slot}")
        with torch.no_grad():
            for n in self._params:
                self._slot_param(slot, n).copy_(state[self._keys[n]].detach())  # casts and moves as it copies
        self._meta[slot].version += 1
        if reset_optimizer:
            self.reset_optimizer(slot)

    def _validate_state(self, state: Mapping[str, torch.Tensor], what: str) -> None:
        validate_adapter_state(state, {k: tuple(self._default[n].shape) for k, n in self._by_key.items()}, what)

    def reset_optimizer(self, slot: int, *, reset_scheduler: bool = True) -> None:
        """Give ``slot`` a fresh optimizer (zero moments, step 0) and, by default, restart its LR schedule."""
        self._check_slot(slot)
        if self.optimizer is not None:
            for p in self.slot_parameters(slot):
                self.optimizer.state.pop(p, None)
        if reset_scheduler:
            self._meta[slot].schedule_step = 0

    def copy_optimizer(self, src: int, dst: int) -> None:
        """Give slot ``dst`` a copy of slot ``src``'s optimizer moments, step count and schedule position."""
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst:
            return
        if self.optimizer is not None:
            for ps, pd in zip(self.slot_parameters(src), self.slot_parameters(dst), strict=True):
                st = self.optimizer.state.get(ps)
                if st:
                    self.optimizer.state[pd] = {
                        k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in st.items()
                    }
                else:
                    self.optimizer.state.pop(pd, None)
        self._meta[dst].schedule_step = self._meta[src].schedule_step

    def apply_plan(
        self,
        entries: Sequence[Any],
        operators: Mapping[str, Any] | None = None,
        *,
        timing: dict[str, float] | None = None,
    ) -> list[int]:
        """Write evolution children into their slots (every child from pre-plan parents); returns the child slots.
        ``timing`` receives the seconds per phase (:func:`~populora_verl.workers.adapter_bank.apply_evolution_plan`)."""
        return apply_evolution_plan(self, entries, operators, timing=timing)

    def shard_checksums(self) -> dict[int, str]:
        """Per slot, a short hash of this rank's copy of its weights (no collective)."""
        import hashlib

        out = {}
        for k in range(self.num_slots):
            h = hashlib.sha1()
            for n in sorted(self._params):
                t = self._slot_param(k, n).detach().to("cpu").contiguous()
                h.update(n.encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            out[k] = h.hexdigest()[:12]
        return out

    # --- training ------------------------------------------------------------------------------------------------

    def _lr_at(self, step: int) -> float:
        if self._base_lr is None:
            return 0.0
        return self._base_lr * (1.0 if self._lambda is None else float(self._lambda(step)))

    def zero_grad(self) -> None:
        for k in range(self.num_slots):
            for p in self.slot_parameters(k):
                p.grad = None

    def optimizer_step(self, max_norm: float | None, trained: Sequence[int]) -> dict[int, float]:
        """One optimizer step for the ``trained`` slots; returns each trained slot's gradient norm before clipping.

        Per slot, as if it trained alone: its gradients averaged over the data-parallel ranks, clipped by its own
        norm, its learning rate at its own schedule position; a slot with a non-finite norm skips this step (as verl
        skips a whole update); slots not in ``trained`` take no step at all.
        """
        if self.optimizer is None:
            raise AdapterBankError("resident adapters were built without an optimizer (a forward-only model)")
        trained = sorted({int(k) for k in trained})
        for k in trained:
            self._check_slot(k)
        keep = set(trained)
        for k in range(self.num_slots):
            if k not in keep:
                for p in self.slot_parameters(k):
                    p.grad = None
        grads_by_slot = {
            k: [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.slot_parameters(k)] for k in trained
        }
        for k in trained:  # a slot whose rows made no gradient here still steps with a zero one, as it would alone
            for p, g in zip(self.slot_parameters(k), grads_by_slot[k], strict=True):
                p.grad = g
        self._all_reduce_grads([g for k in trained for g in grads_by_slot[k]])
        norms: dict[int, float] = {}
        if trained:
            # one multi-tensor norm and one multiply for every trained slot, not a few launches per slot (every slot
            # has the same parameters, so the per-tensor norms reshape to slots x parameters)
            per_tensor = torch.stack(torch._foreach_norm([g for k in trained for g in grads_by_slot[k]]))
            per_slot = torch.linalg.vector_norm(per_tensor.reshape(len(trained), -1), dim=1).float().cpu()
            clip_grads: list[torch.Tensor] = []
            clip_coefs: list[float] = []
            for k, norm in zip(trained, per_slot.tolist(), strict=True):
                norms[k] = norm
                if not math.isfinite(norm):
                    for p in self.slot_parameters(k):
                        p.grad = None
                    continue
                coef = 1.0 if max_norm is None or max_norm <= 0 else min(1.0, max_norm / (norm + 1e-6))
                if coef < 1.0:  # torch's clip_grad_norm_ formula, per slot
                    clip_grads += grads_by_slot[k]
                    clip_coefs += [coef] * len(grads_by_slot[k])
            if clip_grads:
                torch._foreach_mul_(clip_grads, clip_coefs)
        for k in range(self.num_slots):
            self.optimizer.param_groups[k]["lr"] = self._lr_at(self._meta[k].schedule_step)
        self.optimizer.step()
        for k in trained:
            if math.isfinite(norms[k]):
                self._meta[k].updates += 1
                self._stepped.add(k)
        self.zero_grad()
        return norms

    def advance_schedule(self) -> None:
        """One LR-scheduler step for every slot that took an optimizer step since the last call (verl steps its
        scheduler once per update call, after all of the call's mini-batches)."""
        for k in sorted(self._stepped):
            self._meta[k].schedule_step += 1
        self._stepped = set()

    def _all_reduce_grads(self, grads: list[torch.Tensor]) -> None:
        group = self._reduce_group
        if group is None or not grads or not torch.distributed.is_initialized():
            return
        world = torch.distributed.get_world_size(group)
        if world <= 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=group)
        flat /= world
        torch._foreach_copy_(grads, list(torch.split(flat, [g.numel() for g in grads])))  # views back into place

    def learning_rate(self, slot: int) -> float:
        """The LR slot ``slot`` trains with at its next step."""
        self._check_slot(slot)
        return self._lr_at(self._meta[slot].schedule_step)

    # --- persistence (the bank's format) -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's share of every slot, in the bank's file format (a bank resumes from it and vice versa)."""
        slots = []
        for k, meta in enumerate(self._meta):
            params = {
                n: shard_like(self._slot_param(k, n).detach(), self._default[n]).to("cpu", copy=True)
                for n in self._params
            }
            optim: dict[str, dict[str, Any]] = {}
            for n in self._params:
                p = self._slot_param(k, n)
                live = self.optimizer.state.get(p) if self.optimizer is not None else None
                if not live:
                    continue
                st: dict[str, Any] = {}
                for key, val in live.items():
                    if torch.is_tensor(val) and val.shape == p.shape and val.dim() > 0:
                        st[key] = shard_like(val.detach(), self._default[n]).to("cpu", copy=True)
                        st[f"__device__{key}"] = str(self._default[n].device)
                    elif torch.is_tensor(val):
                        st[key] = val.detach().to("cpu", copy=True)
                        st[f"__device__{key}"] = str(val.device)
                    else:
                        st[key] = copy.deepcopy(val)
                optim[n] = st
            slots.append(
                {
                    "params": params,
                    "optim": optim or None,
                    "scheduler": self._scheduler_state(meta),
                    "lrs": [self._lr_at(meta.schedule_step)] if self._base_lr is not None else None,
                    "version": meta.version,
                    "updates": meta.updates,
                }
            )
        return {
            "format_version": BANK_FORMAT_VERSION,
            "layout": self.layout,
            "adapter_name": self.adapter_name,
            "param_names": list(self._params),
            "local_shapes": {n: list(_local(self._default[n]).shape) for n in self._params},
            "slots": slots,
        }

    def _scheduler_state(self, meta: _SlotMeta) -> dict[str, Any] | None:
        if self._sched_template is None:
            return None
        st = copy.deepcopy(self._sched_template)
        st["last_epoch"] = meta.schedule_step
        st["_step_count"] = meta.schedule_step + 1
        st["_last_lr"] = [self._lr_at(meta.schedule_step)] * len(st.get("_last_lr") or [0])
        return st

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from a bank or resident file of this rank (same adapter parameters and world size)."""
        check_saved_bank(state, {n: tuple(_local(p).shape) for n, p in self._default.items()})
        raw_slots = list(state["slots"])
        self._allocate(len(raw_slots))
        with torch.no_grad():
            for k, raw in enumerate(raw_slots):
                for n in self._params:
                    self._slot_param(k, n).copy_(_gather_like(raw["params"][n], self._default[n]))
                for n, st in (raw.get("optim") or {}).items():
                    p = self._slot_param(k, n)
                    live: dict[str, Any] = {}
                    for key, val in st.items():
                        if key.startswith("__device__"):
                            continue
                        if (
                            torch.is_tensor(val)
                            and val.dim() > 0
                            and tuple(val.shape) == tuple(_local(self._default[n]).shape)
                        ):
                            live[key] = _gather_like(val, self._default[n]).to(device=p.device)
                        elif torch.is_tensor(val):
                            was_cpu = str(st.get(f"__device__{key}", "cpu")).startswith("cpu")
                            live[key] = val.clone() if was_cpu else val.to(p.device)
                        else:
                            live[key] = copy.deepcopy(val)
                    if self.optimizer is not None:
                        self.optimizer.state[p] = live
                sched = raw.get("scheduler") or {}
                self._meta[k] = _SlotMeta(
                    version=int(raw.get("version", 0)),
                    updates=int(raw.get("updates", 0)),
                    schedule_step=int(sched.get("last_epoch", 0) or 0),
                )

    def save(self, path: str) -> None:
        """``torch.save`` this rank's share to ``path``, atomically."""
        save_atomically(self.state_dict(), path)

    def load(self, path: str) -> None:
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


def _slot_device(param_device: torch.device) -> torch.device:
    if param_device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return param_device


def _full(p: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a (possibly FSDP2-sharded) parameter, detached."""
    return p.detach().full_tensor() if _is_dtensor(p) else p.detach()


def _gather_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full tensor whose shard on this rank is ``local``, sharded as ``like`` (collective under FSDP2)."""
    if not _is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(_comm_device(like)),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    ).full_tensor()
