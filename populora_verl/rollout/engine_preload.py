"""vLLM's engine-core process forked from a server that imported vLLM already, instead of spawned.

Inside a Ray actor vLLM starts its engine-core process with ``spawn``: a fresh interpreter that imports torch and
vLLM again before it logs a line (21 s on an H200 host, the gap between the server's "Resolved architecture" and the
engine's "Initializing a V1 LLM engine" in BENCHMARKS.md §5). That import sits on the start-up's critical path, after
the FSDP model load. A server actor started early (:mod:`populora_verl.rollout.early_servers`) waits about a minute
for verl's hand-over; with ``trainer.populora_engine_preload`` it starts Python's ``forkserver`` in that wait, with
vLLM's engine modules preloaded there. When vLLM later launches its engine core, the launch module's
``get_mp_context`` (wrapped here, in the server process only) hands out a context whose processes are forked from
that server: the imports are done, nothing else is.

What ``spawn`` gave and a fork from the forkserver would not, the processes here restore:

* the launching process's environment at ``start()`` (vLLM and verl set variables after the forkserver started, among
  them the devices a data-parallel rank sees), applied in the child before vLLM's code runs;
* the choice itself: vLLM's own ``get_mp_context`` still runs first (its environment side effects stay), and only
  where it chose ``spawn`` is the forkserver used; where it chose ``fork``, vLLM's context is returned.

A fork can use CUDA only where the forkserver's imports neither initialized it nor asked the CUDA driver for its
devices (torch then marks every fork unusable); the forkserver imports with torch's NVML-based checks, and before the
first engine core the server forks one probe (:func:`probe`): where it cannot use CUDA, vLLM's spawn stays.
A forked engine core is the forkserver's child, not the server's: it watches the server process and ends with it, as
vLLM's own parent-death signal ends a spawned one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "ENGINE_MODULES",
    "PreloadedContext",
    "start",
    "started",
    "install",
    "engine_launch_module",
    "fork_state",
    "probe",
    "unusable",
]

#: What the engine-core process imports that the server process itself imports without touching CUDA (and vLLM imports
#: before it forks outside Ray); vLLM's GPU worker is left to the engine core, after the fork. A module that fails to
#: import in the forkserver is skipped there (the engine core imports it itself).
ENGINE_MODULES = (
    "torch",
    "vllm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.abstract",
    "verl.workers.rollout.vllm_rollout.utils",
    "populora_verl.rollout.vllm_extension",
)

PRELOADER = "populora_verl.rollout._preload"
PRELOAD_ENV = "POPULORA_PRELOAD_MODULES"

_STATE: dict[str, Any] = {}
_LOCK = threading.Lock()


class _EnvProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver process that runs with its launcher's environment as of ``start()`` and ends with its launcher."""

    def start(self) -> None:
        self._populora_env = dict(os.environ)
        self._populora_launcher = os.getpid()
        super().start()

    def run(self) -> None:
        env = getattr(self, "_populora_env", None)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        launcher = getattr(self, "_populora_launcher", None)
        if launcher is not None:
            _end_with(launcher)
        super().run()


class PreloadedContext(multiprocessing.context.ForkServerContext):
    """Python's forkserver context with :class:`_EnvProcess` as its ``Process``."""

    Process = _EnvProcess


def _end_with(pid: int) -> None:
    """SIGKILL this process once process ``pid`` has exited. The forkserver, this process's parent, outlives the
    launcher while any of its children lives, so the kernel's parent-death signal (which vLLM may set) never fires."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = -1  # gone already
        except (AttributeError, OSError):  # no pidfd on this kernel or platform: poll
            fd = None
        if fd is None:
            while _exists(pid):
                time.sleep(1.0)
        elif fd >= 0:
            select.select([fd], [], [])  # a pidfd reads ready when its process exits
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="populora-launcher-watch", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start(modules: Sequence[str] = ENGINE_MODULES) -> bool:
    """Start this process's forkserver with ``modules`` preloaded (once; the imports run in the forkserver, so this
    returns at once). False where the process's forkserver had started already without them."""
    from multiprocessing import forkserver

    with _LOCK:
        if "context" in _STATE:
            return _STATE["preloaded"]
        running = getattr(forkserver._forkserver, "_forkserver_pid", None) is not None
        ctx = PreloadedContext()
        if not running:
            ctx.set_forkserver_preload([PRELOADER])
        # The forkserver gets the list through its environment, read by PRELOADER; and this process's sys.path as
        # PYTHONPATH (Python 3.11's forkserver imports with the interpreter's default path, without a Ray worker's
        # runtime env or code added at run time). Both for its launch only.
        # PYTORCH_NVML_BASED_CUDA_CHECK: torch.cuda.is_available() and device_count(), which vLLM's imports call, ask
        # NVML instead of the CUDA driver; through the driver, torch marks every later fork unable to use CUDA
        extra = {
            PRELOAD_ENV: ",".join(modules),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        }
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _STATE.update(context=ctx, preloaded=not running, started_at=time.monotonic())
        return not running


def started() -> bool:
    return "context" in _STATE


def engine_launch_module() -> Any | None:
    """The vLLM module whose ``get_mp_context`` creates the engine-core processes (None: not found)."""
    try:
        from vllm.v1.engine import utils as engine_utils
    except ImportError:
        return None
    manager = getattr(engine_utils, "CoreEngineProcManager", None)
    module = sys.modules.get(getattr(manager, "__module__", ""), engine_utils)
    return module if callable(getattr(module, "get_mp_context", None)) else None


def fork_state() -> dict[str, bool]:
    """In a process forked from the forkserver: whether CUDA is usable here (torch marks a fork whose parent had
    initialized CUDA, or asked the CUDA driver for the device count, as unable to use it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"cuda_initialized": False, "bad_fork": False}
    return {"cuda_initialized": bool(torch.cuda.is_initialized()), "bad_fork": bool(torch.cuda._is_in_bad_fork())}


def _probe_child(conn: Any) -> None:
    conn.send(fork_state())
    conn.close()


def probe(ctx: Any) -> dict[str, bool]:
    """:func:`fork_state` of one process forked from ``ctx``'s forkserver (its imports are done by then)."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    p = ctx.Process(target=_probe_child, args=(writer,), daemon=True)
    p.start()
    writer.close()
    try:
        return reader.recv()
    except EOFError:  # the probe died: nothing known, so not usable
        return {"cuda_initialized": True, "bad_fork": True}
    finally:
        p.join()


def unusable(state: dict[str, bool]) -> str | None:
    """Why a fork from the forkserver cannot run vLLM's engine core (None: it can)."""
    if state.get("cuda_initialized"):
        return "the forkserver's imports initialized CUDA"
    if state.get("bad_fork"):
        return "torch marks its forks unable to use CUDA (the forkserver's imports asked the CUDA driver)"
    return None


def wrap_get_mp_context(original: Callable[[], Any]) -> Callable[[], Any]:
    """``original`` (vLLM's ``get_mp_context``), answering with the preloaded forkserver where it chose ``spawn`` and a
    probe forked from it can use CUDA (else vLLM's spawn, and one line that says why)."""

    def get_mp_context() -> Any:
        ctx = original()  # vLLM's checks and their environment side effects (RAY_ADDRESS, the start method)
        if ctx.get_start_method() != "spawn" or "context" not in _STATE:
            return ctx
        if "unusable" not in _STATE:
            _STATE["unusable"] = unusable(probe(_STATE["context"]))
        if _STATE["unusable"]:
            print(f"[populora] vLLM engine core spawned: {_STATE['unusable']}", flush=True)
            return ctx
        print(
            f"[populora] vLLM engine core forked from the preloaded forkserver (started "
            f"{time.monotonic() - _STATE['started_at']:.0f} s before)",
            flush=True,
        )
        return _STATE["context"]

    get_mp_context.__wrapped__ = original  # type: ignore[attr-defined]
    return get_mp_context


def install(module: Any | None = None) -> str | None:
    """Wrap ``module.get_mp_context`` (vLLM's engine launch module by default) in this process; None when done, else
    why not (vLLM's own spawn then stays)."""
    module = module if module is not None else engine_launch_module()
    if module is None:
        return "vLLM's engine launch module (CoreEngineProcManager's get_mp_context) not found"
    current = module.get_mp_context
    if getattr(current, "__wrapped__", None) is None:
        module.get_mp_context = wrap_get_mp_context(current)
    return None
