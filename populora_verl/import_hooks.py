"""Call a function right after a module has been imported, without importing it (standard library only).

verl keeps each registry (trainers, advantage estimators, reward managers, rollout backends, agent loops) as a dict in
the module that defines it, and has no lazy registry: an entry exists only once something writes it into that dict,
which needs the module imported. verl imports the plugin in every process at ``import verl``, and importing every
registry module there cost each process of a run seconds and thousands of modules (the trainer's stack, the agent
loop, datasets, fastapi, ...) for registries that most of them never read. :func:`after_import` lets the plugin write
each entry when, and only when, the process imports the module that holds the registry: at once if it is imported
already, otherwise right after that module has finished executing, before the statement that imported it goes on.

How: :class:`AfterImportFinder` sits at the front of ``sys.meta_path`` while something waits. Asked for a watched
module, it finds the real spec with the other finders and hands it back with a loader whose ``exec_module`` runs the
real one, then the callbacks; for any other module it answers ``None`` and the import goes on as before. It leaves
``sys.meta_path`` once no callback waits. A callback that raises is logged (one warning line) and never fails the
import of the module it waited for.

A module that is being imported right now (``after_import`` called from inside its own import) cannot be watched to
its end: its callbacks wait, listed by :func:`pending`, until :func:`run_pending` is called for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Callback", "AfterImportFinder", "after_import", "is_imported", "pending", "run_pending"]

#: Called with the imported module.
Callback = Callable[[ModuleType], None]


def is_imported(name: str) -> bool:
    """Whether module ``name`` is in ``sys.modules`` and has finished executing (not half-way through its import)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _CallbackLoader(importlib.abc.Loader):
    """The real loader of a watched module, whose ``exec_module`` then calls the finder's callbacks for it.

    Everything else is the real loader's (``__getattr__``); after the module executed, its ``__loader__`` and
    ``__spec__.loader`` are the real loader again."""

    def __init__(self, loader: importlib.abc.Loader, finder: AfterImportFinder, name: str) -> None:
        self._loader = loader
        self._finder = finder
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:  # the module's own attributes name the real loader, whatever happened
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        # executed without raising; the module is the one in sys.modules (which a module may replace with another)
        current = sys.modules.get(self._name)
        if current is not None:
            self._finder._fire(self._name, current)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        if attr == "_loader":  # not set yet (a copy made without __init__): no recursion
            raise AttributeError(attr)
        return getattr(self._loader, attr)


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """Watches the modules that callbacks wait for; one instance (``_FINDER``) serves the process."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[Callback]] = {}
        self._lock = threading.RLock()

    # --- the import system's side ---------------------------------------------------------------------------------

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._waiting:
            return None
        spec = self._real_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not found, a namespace package or a legacy loader: the import goes on without us
        spec.loader = _CallbackLoader(spec.loader, self, fullname)
        return spec

    def _real_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec that the finders after this one give (as the import system would ask them)."""
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, AfterImportFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    # --- the callbacks' side --------------------------------------------------------------------------------------

    def add(self, name: str, callback: Callback) -> None:
        with self._lock:
            self._waiting.setdefault(name, []).append(callback)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def waiting(self) -> dict[str, int]:
        with self._lock:
            return {name: len(callbacks) for name, callbacks in self._waiting.items()}

    def _fire(self, name: str, module: ModuleType) -> None:
        with self._lock:
            callbacks = self._waiting.pop(name, [])
            if not self._waiting and self in sys.meta_path:
                sys.meta_path.remove(self)
        for callback in callbacks:
            _call(callback, name, module)


def _call(callback: Callback, name: str, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as e:  # never fail the import of the module that was waited for
        logger.warning("callback %r after the import of %s failed: %s: %s", callback, name, type(e).__name__, e)


_FINDER = AfterImportFinder()


def after_import(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported in this process: now if it has, else right
    after its import finishes (it is not imported here). See the module's docstring."""
    if is_imported(name):
        _call(callback, name, sys.modules[name])
        return
    _FINDER.add(name, callback)


def pending() -> dict[str, int]:
    """The modules that callbacks still wait for, with how many wait for each."""
    return _FINDER.waiting()


def run_pending(name: str) -> bool:
    """Call the callbacks still waiting for ``name`` now, if it has been imported (a module that was half-way through
    its import when they were added); returns whether ``name`` is imported (then nothing waits for it any more)."""
    if not is_imported(name):
        return False
    _FINDER._fire(name, sys.modules[name])
    return True
