"""The executor: evaluate ``f(<inputs>)`` of untrusted programs in a sandbox, AZR's validity semantics."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from populora_verl.config import AZR_BANNED_MODULES
from populora_verl.executor._runner import find_banned

if TYPE_CHECKING:
    from populora_verl.config import ExecutorConfig

logger = logging.getLogger(__name__)

AZR_BANNED = AZR_BANNED_MODULES
MAX_PROGRAM_CHARS = 200_000
AZR_STORED_CHARS = 400


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one evaluation. ``output`` is ``repr(f(inputs))`` when ``ok``; ``error`` a short reason."""

    ok: bool
    output: str | None
    error: str | None
    duration_s: float

    @property
    def error_kind(self) -> str | None:
        """The reason's category: timeout, memory, banned import, nondeterministic, output too large,
        crashed, bad request, or the exception type name (``ValueError``...)."""
        if self.error is None:
            return None
        return self.error.split(":", 1)[0]


def check_program(program: str, banned_modules: Sequence[str] = AZR_BANNED) -> str | None:
    """Static banned-module check (AST walk); a reason string or None. Never executes anything."""
    return find_banned(program, list(banned_modules))


def truncate_middle(text: str, limit: int = AZR_STORED_CHARS) -> str:
    """AZR's stored-output truncation: keep both ends, '...' in the middle, at most ``limit`` chars."""
    if len(text) <= limit:
        return text
    keep = limit - 3
    return text[: (keep + 1) // 2] + "..." + text[len(text) - keep // 2:]


class Executor:
    """Sandboxed evaluator of ``f(<inputs>)``; a context manager. Safe to call from several threads.

    Args:
        timeout_s: wall-clock limit per evaluation (both determinism calls together); CPU time is capped too.
        memory_mb: address-space limit of the process running the program.
        max_workers: parallel sandbox slots (default: number of CPUs).
        max_output_chars: a larger ``repr`` is an error ("output too large"), checked before the second call.
        check_determinism: default for ``run``: call ``f`` twice in one process, reject differing results.
        banned_modules: AZR's banned-module policy (static AST check + runtime import guard in the child).
        truncate_output: whether ``store_output`` applies AZR's 400-char middle truncation.
        backend: ``local`` (namespaced workers on this host) or ``sandbox_fusion`` (remote HTTP service).
        sandbox_fusion_url: the ``run_code`` endpoint for ``backend="sandbox_fusion"``.
        isolation: ``auto`` (namespaces when allowed) or ``rlimits`` (no namespaces; for containers/tests).
        max_processes: RLIMIT_NPROC of a slot's uid (fork bombs stop there).
        file_size_mb, tmp_mb: largest file a program may write; size of the private /tmp.
    """

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, *, max_workers: int | None = None,
                 max_output_chars: int = 100_000, check_determinism: bool = True,
                 banned_modules: Iterable[str] = AZR_BANNED, truncate_output: bool = True, backend: str = "local",
                 sandbox_fusion_url: str | None = None, isolation: str = "auto", max_processes: int = 16,
                 file_size_mb: int = 16, tmp_mb: int = 64, grace_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if memory_mb < 32:
            raise ValueError(f"memory_mb must be >= 32, got {memory_mb!r}")
        if isolation not in ("auto", "rlimits"):
            raise ValueError(f"isolation must be 'auto' or 'rlimits', got {isolation!r}")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.check_determinism = bool(check_determinism)
        self.banned_modules = list(banned_modules)
        self.truncate_output = bool(truncate_output)
        workers = max_workers or os.cpu_count() or 1
        if backend == "local":
            from populora_verl.executor.local import LocalBackend

            settings = {"banned": self.banned_modules, "nproc": int(max_processes), "fsize_mb": int(file_size_mb),
                        "tmp_mb": int(tmp_mb)}
            self._backend = LocalBackend(num_workers=workers, settings=settings, isolation=isolation,
                                         grace_s=grace_s)
        elif backend == "sandbox_fusion":
            from populora_verl.executor.sandbox_fusion import SandboxFusionBackend

            self._backend = SandboxFusionBackend(sandbox_fusion_url or "", num_workers=workers)
        else:
            raise ValueError(f"backend must be 'local' or 'sandbox_fusion', got {backend!r}")
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="populora-exec")
        self._closed = False
        on = [k for k, v in self.protections.items() if v]
        off = [k for k, v in self.protections.items() if not v]
        logger.info("populora executor: backend=%s workers=%d active protections: %s%s%s", backend, workers,
                    ", ".join(on) or "none", f"; OFF: {', '.join(off)}" if off else "",
                    f" ({'; '.join(self._backend.notes)})" if self._backend.notes else "")

    @classmethod
    def from_config(cls, cfg: ExecutorConfig, **overrides) -> Executor:
        kwargs = dict(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, max_workers=cfg.max_workers,
                      max_output_chars=cfg.max_output_chars, check_determinism=cfg.check_determinism,
                      banned_modules=cfg.banned_modules, truncate_output=cfg.truncate_output, backend=cfg.backend,
                      sandbox_fusion_url=cfg.sandbox_fusion_url)
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def protections(self) -> dict[str, bool]:
        """Which isolation measures are active (name -> on)."""
        base = {"separate_process": True, "rlimits": self.backend == "local", "static_import_check": True,
                "runtime_import_guard": self.backend == "local", "clean_environment": True}
        return {**base, **self._backend.protections}

    @property
    def num_workers(self) -> int:
        return self._backend.num_workers

    def run(self, program: str, inputs: str, *, check_determinism: bool | None = None,
            timeout_s: float | None = None) -> ExecResult:
        """Evaluate ``f(<inputs>)``; never raises for a bad program (only for a closed executor)."""
        if self._closed:
            raise RuntimeError("Executor is closed")
        start = time.monotonic()
        if not isinstance(program, str) or not isinstance(inputs, str):
            return ExecResult(False, None, "bad request: program and inputs must be str", 0.0)
        if len(program) > MAX_PROGRAM_CHARS or len(inputs) > MAX_PROGRAM_CHARS:
            return ExecResult(False, None, f"bad request: program or inputs over {MAX_PROGRAM_CHARS} chars", 0.0)
        if "\x00" in program or "\x00" in inputs:
            return ExecResult(False, None, "bad request: NUL byte in program or inputs", 0.0)
        req = {"program": program, "inputs": inputs, "timeout_s": float(timeout_s or self.timeout_s),
               "memory_mb": self.memory_mb, "max_output_chars": self.max_output_chars,
               "check_determinism": self.check_determinism if check_determinism is None else bool(check_determinism)}
        if self.backend == "sandbox_fusion":
            reason = check_program(program, self.banned_modules)  # the remote side has no import guard
            if reason:
                return ExecResult(False, None, reason, time.monotonic() - start)
        try:
            res = self._backend.run(req)
        except Exception as e:  # noqa: BLE001 - the contract: a bad program never raises into the caller
            logger.exception("executor backend failure")
            return ExecResult(False, None, f"crashed: {type(e).__name__}: {e}"[:300], time.monotonic() - start)
        output = res.get("output")
        return ExecResult(bool(res.get("ok")), output if isinstance(output, str) else None,
                          None if res.get("ok") else str(res.get("error") or "crashed: unknown"),
                          float(res.get("duration_s", time.monotonic() - start)))

    def run_many(self, items: Iterable[tuple[str, str]], *, check_determinism: bool | None = None,
                 timeout_s: float | None = None) -> list[ExecResult]:
        """Evaluate a batch in parallel across the sandbox slots; results in input order."""
        items = list(items)
        return list(self._pool.map(lambda it: self.run(it[0], it[1], check_determinism=check_determinism,
                                                       timeout_s=timeout_s), items))

    def store_output(self, result: ExecResult) -> str | None:
        """The output as AZR stores it for a task (middle-truncated to 400 chars if ``truncate_output``)."""
        if result.output is None:
            return None
        return truncate_middle(result.output) if self.truncate_output else result.output

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._backend.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
