"""Sandboxed, deterministic execution of untrusted AZR-style programs (``f(<inputs>)``).

``Executor`` (local namespaced workers or a remote SandboxFusion service), ``ExecResult``, and the static
banned-module check ``check_program``. See docs/executor.md for the threat model.
"""

from populora_verl.executor.core import AZR_BANNED, ExecResult, Executor, check_program, truncate_middle

__all__ = ["AZR_BANNED", "ExecResult", "Executor", "check_program", "truncate_middle"]
