"""Device-free memory accounting: the bytes of tensor storage a block allocates and keeps, and what autograd saves.

``torch.cuda.max_memory_allocated`` needs a GPU, and the CPU allocator keeps no statistics, so a question such as
"which term of a training step's peak grows with the tokens of a micro-batch" cannot be asked on a CPU through the
allocator. These tools answer it from the tensors themselves, deterministically (same code, same shapes, same
bytes), which a test can bound:

* :class:`LiveBytes` (a ``TorchDispatchMode``) sees every aten op's outputs. A storage that no input of the op
  shares is new: its bytes count as live until the storage is freed (a ``weakref.finalize`` on it; torch keeps one
  Python object per storage, so the callback fires when the last tensor on it dies). ``peak`` is the most bytes
  live at once since the last :meth:`LiveBytes.reset_peak`, over what existed before the block (parameters,
  optimizer state, the batch), as ``torch.cuda.max_memory_allocated`` after a reset would count it less the
  baseline. Scratch a kernel allocates and frees inside itself is not seen (the allocator would count it), and
  frees of storages from before the block do not lower the count.
* :class:`SavedBytes` (``saved_tensors_hooks``) sums the distinct storages autograd saves for backward, split into
  those allocated inside a :class:`LiveBytes` block (activations) and older ones (parameters).

Jagged nested tensors and other wrapper subclasses are counted by their inner tensors.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "SavedBytes", "storages"]


def storages(t: Any) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or its inner tensors' for a wrapper subclass (a jagged nested tensor)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from storages(getattr(t, name))
        return
    yield t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated inside the block and still alive: ``live`` now, ``peak`` since the last
    :meth:`reset_peak`, ``allocated`` in total (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocated = 0
        self._sizes: dict[int, int] = {}  # data_ptr of a tracked storage -> its bytes

    def owns(self, st: torch.UntypedStorage) -> bool:
        """Whether ``st`` was allocated inside the block (and is alive)."""
        return st.data_ptr() in self._sizes and self._sizes[st.data_ptr()] == st.nbytes()

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, ptr: int) -> None:
        self.live -= self._sizes.pop(ptr, 0)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {st.data_ptr() for a in tree_leaves((args, kwargs)) for st in storages(a)}
        for t in tree_leaves(out):
            for st in storages(t):
                ptr, nbytes = st.data_ptr(), st.nbytes()
                if not nbytes or ptr in inputs or ptr in self._sizes:
                    continue  # a view or an in-place result, or a storage already counted
                self._sizes[ptr] = nbytes
                self.live += nbytes
                self.allocated += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._freed, ptr)
        return out


class SavedBytes:
    """Distinct storages autograd saves for backward while the block runs: ``activations`` (allocated inside
    ``live``'s block) and ``other`` (older: parameters, the batch). :meth:`reset` starts a new count (per
    micro-batch)."""

    def __init__(self, live: LiveBytes | None = None) -> None:
        self.live = live
        self.activations = 0
        self.other = 0
        self._seen: set[int] = set()

    def reset(self) -> None:
        self.activations = self.other = 0
        self._seen = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for st in storages(t):
            if st.data_ptr() in self._seen:
                continue
            self._seen.add(st.data_ptr())
            if self.live is not None and self.live.owns(st):
                self.activations += st.nbytes()
            else:
                self.other += st.nbytes()
        return t

    @contextlib.contextmanager
    def __call__(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
