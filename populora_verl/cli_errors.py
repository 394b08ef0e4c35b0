"""One-line errors for the console scripts (``populora-local``, ``populora-eval``, ``populora-report``).

A user who mistypes a path should read one line that says what is wrong, not a 40-line traceback; ``--debug``
brings the traceback back for a bug report.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["one_line", "run_cli"]

# Exceptions whose message already says everything; others are prefixed with their type.
_PLAIN = ("ConfigError", "CheckpointError", "FileNotFoundError", "FileExistsError", "NotADirectoryError")


def one_line(e: BaseException) -> str:
    """``e`` as one line: its message with whitespace collapsed (prefixed by its type unless self-explanatory)."""
    text = " ".join(str(e).split())
    if len(text) > 400:
        text = text[:400] + " ..."
    if type(e).__name__ in _PLAIN and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def run_cli(prog: str, fn: Callable[[], int], *, debug: bool = False,
            on_interrupt: Callable[[], str] | None = None) -> int:
    """Run ``fn``; an exception ends it with one ``prog: error: ...`` line on stderr (exit 1), Ctrl-C with one line
    (``on_interrupt()``'s text, exit 130). ``debug`` re-raises instead."""
    try:
        return fn()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{prog}: {on_interrupt() if on_interrupt else 'interrupted'}", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e.code, str) and not debug:  # raise SystemExit("message"): the same one-line form
            print(f"{prog}: error: {' '.join(e.code.split())}", file=sys.stderr)
            return 1
        raise
    except Exception as e:  # noqa: BLE001 - the point is to catch everything the user may trigger
        if debug:
            raise
        print(f"{prog}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1
