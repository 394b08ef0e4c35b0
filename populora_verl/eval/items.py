"""A benchmark problem and the jsonl reader every benchmark loader uses (:mod:`.data`, :mod:`.lcb`)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Item", "read_jsonl"]


@dataclass(frozen=True)
class Item:
    """One benchmark problem. ``kind`` is ``code`` or ``math``; ``question`` is what the prompt shows; ``gold`` is
    the reference answer (math: a LaTeX/number string) or the test specification (code: a dict)."""

    benchmark: str
    id: str
    kind: str
    question: str
    gold: Any
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object per line")
            yield row
