"""The executor: evaluate ``f(<inputs>)`` of untrusted programs in a sandbox, AZR's validity semantics."""

from __future__ import annotations

import ast
import logging
import os
import time
import unicodedata
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from populora_verl.config import AZR_BANNED_MODULES, executor_limit_problems
from populora_verl.executor._runner import find_banned

if TYPE_CHECKING:
    from populora_verl.config import ExecutorConfig

logger = logging.getLogger(__name__)

AZR_BANNED = AZR_BANNED_MODULES
MAX_PROGRAM_CHARS = 200_000
AZR_STORED_CHARS = 400


# Kept as they are in reason text: newline and tab. Escaped: the other control characters (NUL, ESC, C1),
# lone surrogates, format characters (bidi overrides, zero-width) and line/paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cs", "Cf", "Zl", "Zp"})


def safe_text(text: str) -> str:
    """``text`` fit for logs, metrics and prompts: characters that could drive a terminal, hide text or fail
    UTF-8 encoding become ``\\xNN``/``\\uNNNN`` escapes; newlines, tabs and printable text are kept.

    Reason text (an exception message from the program, a parser's complaint about model text) is made of
    model output: this is applied where it leaves the executor (:class:`ExecResult`) and where proposal and
    answer reasons are built (``tasks/verify.py``)."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t" or unicodedata.category(ch) not in _UNSAFE_CATEGORIES:
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one evaluation. ``output`` is ``repr(f(inputs))`` when ``ok``; ``error`` a short reason
    (escaped with :func:`safe_text`: the program writes its exception messages)."""

    ok: bool
    output: str | None
    error: str | None
    duration_s: float

    def __post_init__(self) -> None:
        if isinstance(self.error, str):
            object.__setattr__(self, "error", safe_text(self.error))

    @property
    def error_kind(self) -> str | None:
        """The reason's category: timeout, memory, banned import, nondeterministic, output too large,
        crashed, bad request, or the exception type name (``ValueError``...)."""
        if self.error is None:
            return None
        return self.error.split(":", 1)[0]


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # lone surrogates
        return False


def literal_problem(text: str) -> str | None:
    """Why ``text`` is not the repr of plain data, or None.

    Plain data: one literal of builtin types (``ast.literal_eval`` reads it back: numbers, strings, bytes,
    booleans, None, tuples, lists, sets, dicts), printed on one line with every non-printable character
    escaped, so that it is valid UTF-8 and safe in a prompt or a terminal.
    """
    if not text.isprintable():
        return "text has non-printable characters (NUL, escapes, surrogates, newlines)"
    try:
        ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return "not a literal of builtin types"
    return None


def check_program(program: str, banned_modules: Sequence[str] = AZR_BANNED) -> str | None:
    """Static banned-module check (AST walk); a reason string or None. Never executes anything."""
    return find_banned(program, list(banned_modules))


def truncate_middle(text: str, limit: int = AZR_STORED_CHARS) -> str:
    """AZR's stored-output truncation: keep both ends, '...' in the middle, at most ``limit`` chars."""
    if len(text) <= limit:
        return text
    keep = limit - 3
    return text[: (keep + 1) // 2] + "..." + text[len(text) - keep // 2 :]


class Executor:
    """Sandboxed evaluator of ``f(<inputs>)``; a context manager. Safe to call from several threads.

    Args:
        timeout_s: wall-clock limit per evaluation (both determinism calls together); CPU time is capped too.
        memory_mb: memory limit of a call (address space per process; whole call where cgroups allow).
        max_workers: parallel sandbox slots (default: number of CPUs).
        max_output_chars: a larger ``repr`` is an error ("output too large"), checked before the second call.
        check_determinism: default for ``run``: call ``f`` twice in one process (AZR), then once more in a second,
            independent process (other pid, heap layout, clocks, random state); reject differing results.
        banned_modules: AZR's banned-module policy (static AST check + runtime import guard in the child).
        truncate_output: whether ``store_output`` applies AZR's 400-char middle truncation (prompts only).
        backend: ``local`` (namespaced workers on this host) or ``sandbox_fusion`` (remote HTTP service).
        sandbox_fusion_url: the ``run_code`` endpoint for ``backend="sandbox_fusion"``.
        isolation: ``auto`` (namespaces when allowed) or ``rlimits`` (no namespaces; for containers/tests).
        max_processes: RLIMIT_NPROC of a slot's uid (fork bombs stop there).
        file_size_mb, tmp_mb: largest file a program may write; size of the private /tmp.
        memory_cgroup: cap a call's total memory (shared memory, memfd, tmpfs) with a memory cgroup per slot
            where the host allows it (else RLIMIT_AS only; the start-up log says which).
        plain_data: outputs must be plain data (literals of builtin types, see :func:`literal_problem`);
            anything else is the error "not plain data". Checked in the sandbox and again here.
        hidden_paths: folders the sandbox covers with an empty one (default: this process's working directory
            and home, where run folders and their saved golds live); needs the namespaces.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        *,
        max_workers: int | None = None,
        max_output_chars: int = 100_000,
        check_determinism: bool = True,
        banned_modules: Iterable[str] = AZR_BANNED,
        truncate_output: bool = True,
        backend: str = "local",
        sandbox_fusion_url: str | None = None,
        isolation: str = "auto",
        max_processes: int = 16,
        file_size_mb: int = 16,
        tmp_mb: int = 64,
        grace_s: float = 5.0,
        memory_cgroup: bool = True,
        plain_data: bool = True,
        hidden_paths: Iterable[str] | None = None,
    ) -> None:
        for key, why in executor_limit_problems(timeout_s, memory_mb).items():
            raise ValueError(f"{key} {why}")
        if isolation not in ("auto", "rlimits"):
            raise ValueError(f"isolation must be 'auto' or 'rlimits', got {isolation!r}")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.check_determinism = bool(check_determinism)
        self.banned_modules = list(banned_modules)
        self.truncate_output = bool(truncate_output)
        self.plain_data = bool(plain_data)
        workers = max_workers or os.cpu_count() or 1
        if backend == "local":
            from populora_verl.executor.local import LocalBackend

            settings = {
                "banned": self.banned_modules,
                "nproc": int(max_processes),
                "fsize_mb": int(file_size_mb),
                "tmp_mb": int(tmp_mb),
                "memory_mb": self.memory_mb,
            }
            if hidden_paths is not None:
                settings["hide"] = [os.path.realpath(p) for p in hidden_paths]
            self._backend = LocalBackend(
                num_workers=workers,
                settings=settings,
                isolation=isolation,
                grace_s=grace_s,
                memory_cgroup=memory_cgroup,
            )
        elif backend == "sandbox_fusion":
            from populora_verl.executor.sandbox_fusion import SandboxFusionBackend

            self._backend = SandboxFusionBackend(
                sandbox_fusion_url or "", num_workers=workers, banned=self.banned_modules
            )
        else:
            raise ValueError(f"backend must be 'local' or 'sandbox_fusion', got {backend!r}")
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="populora-exec")
        self._closed = False
        on = [k for k, v in self.protections.items() if v]
        off = [k for k, v in self.protections.items() if not v]
        logger.info(
            "populora executor: backend=%s workers=%d active protections: %s%s%s",
            backend,
            workers,
            ", ".join(on) or "none",
            f"; OFF: {', '.join(off)}" if off else "",
            f" ({'; '.join(self._backend.notes)})" if self._backend.notes else "",
        )

    @classmethod
    def from_config(cls, cfg: ExecutorConfig, **overrides) -> Executor:
        kwargs = dict(
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
            max_workers=cfg.max_workers,
            max_output_chars=cfg.max_output_chars,
            check_determinism=cfg.check_determinism,
            banned_modules=cfg.banned_modules,
            truncate_output=cfg.truncate_output,
            backend=cfg.backend,
            sandbox_fusion_url=cfg.sandbox_fusion_url,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def protections(self) -> dict[str, bool]:
        """Which isolation measures are active (name -> on)."""
        base = {
            "separate_process": True,
            "rlimits": True,
            "static_import_check": True,
            "runtime_import_guard": True,
            "clean_environment": True,
        }
        return {**base, **self._backend.protections}

    @property
    def num_workers(self) -> int:
        return self._backend.num_workers

    def _prepare(
        self, program: str, inputs: str, check_determinism: bool | None, timeout_s: float | None
    ) -> dict | ExecResult:
        """The request for the backend, or the result when the request is refused here."""
        if not isinstance(program, str) or not isinstance(inputs, str):
            return ExecResult(False, None, "bad request: program and inputs must be str", 0.0)
        if len(program) > MAX_PROGRAM_CHARS or len(inputs) > MAX_PROGRAM_CHARS:
            return ExecResult(False, None, f"bad request: program or inputs over {MAX_PROGRAM_CHARS} chars", 0.0)
        if "\x00" in program or "\x00" in inputs:
            return ExecResult(False, None, "bad request: NUL byte in program or inputs", 0.0)
        if not (_encodable(program) and _encodable(inputs)):
            return ExecResult(False, None, "bad request: program or inputs not UTF-8 encodable", 0.0)
        if self.backend == "sandbox_fusion":
            reason = check_program(program, self.banned_modules)  # before anything leaves this machine
            if reason:
                return ExecResult(False, None, reason, 0.0)
        return {
            "program": program,
            "inputs": inputs,
            "timeout_s": float(timeout_s or self.timeout_s),
            "memory_mb": self.memory_mb,
            "max_output_chars": self.max_output_chars,
            "plain_data": self.plain_data,
            "check_determinism": self.check_determinism if check_determinism is None else bool(check_determinism),
        }

    def _finish(self, res: dict, start: float) -> ExecResult:
        """The backend's reply, checked here again: the sandbox's word on size and shape is not trusted."""
        duration = float(res.get("duration_s", time.monotonic() - start))
        output = res.get("output")
        if not res.get("ok"):
            return ExecResult(False, None, str(res.get("error") or "crashed: unknown")[:300], duration)
        if not isinstance(output, str):
            return ExecResult(False, None, "crashed: malformed result", duration)
        if len(output) > self.max_output_chars:
            return ExecResult(False, None, f"output too large: {len(output)} chars > {self.max_output_chars}", duration)
        if self.plain_data:
            problem = literal_problem(output)
            if problem:
                return ExecResult(False, None, f"not plain data: {problem}", duration)
        elif not _encodable(output):
            return ExecResult(False, None, "not plain data: output not UTF-8 encodable", duration)
        return ExecResult(True, output, None, duration)

    def run(
        self, program: str, inputs: str, *, check_determinism: bool | None = None, timeout_s: float | None = None
    ) -> ExecResult:
        """Evaluate ``f(<inputs>)``; never raises for a bad program (only for a closed executor)."""
        return self.run_many([(program, inputs)], check_determinism=check_determinism, timeout_s=timeout_s)[0]

    def run_many(
        self, items: Iterable[tuple[str, str]], *, check_determinism: bool | None = None, timeout_s: float | None = None
    ) -> list[ExecResult]:
        """Evaluate a batch in parallel across the sandbox slots; results in input order.

        Requests go to a slot in small batches (one round trip each), so that a slot never waits for the
        host between two programs.
        """
        if self._closed:
            raise RuntimeError("Executor is closed")
        start = time.monotonic()
        prepared = [self._prepare(p, i, check_determinism, timeout_s) for p, i in items]
        todo = [k for k, r in enumerate(prepared) if isinstance(r, dict)]
        out: list[ExecResult | None] = [r if isinstance(r, ExecResult) else None for r in prepared]
        if not todo:
            return out  # type: ignore[return-value]
        size = max(1, min(8, -(-len(todo) // (4 * self.num_workers))))
        chunks = [todo[k : k + size] for k in range(0, len(todo), size)]
        run_batch = getattr(self._backend, "run_batch", None)

        def one_chunk(idx: list[int]) -> list[dict]:
            reqs = [prepared[k] for k in idx]
            try:
                if run_batch is not None:
                    return run_batch(reqs)
                return [self._backend.run(r) for r in reqs]
            except Exception as e:  # noqa: BLE001 - the contract: a bad program never raises into the caller
                logger.exception("executor backend failure")
                return [{"ok": False, "error": f"crashed: {type(e).__name__}: {e}"[:300]} for _ in reqs]

        replies = self._pool.map(one_chunk, chunks) if len(chunks) > 1 else [one_chunk(chunks[0])]
        for idx, batch in zip(chunks, replies):
            for k, res in zip(idx, batch):
                out[k] = self._finish(res if isinstance(res, dict) else {}, start)
        return out  # type: ignore[return-value]

    def store_output(self, result: ExecResult) -> str | None:
        """The output as a prompt shows it (AZR's 400-char middle truncation if ``truncate_output``); tasks
        keep the full output and are judged on it."""
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
