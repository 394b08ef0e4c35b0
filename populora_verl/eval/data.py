"""Offline benchmark loaders: every benchmark reads from a local path, never from a hub.

Data directory (first that applies): the ``data_dir`` argument / ``--data-dir``, env ``POPULORA_BENCHMARKS``, else
the package's own copy (``populora_verl/eval/benchmark_data``: HumanEval+, MBPP+, GSM8K, MATH-500, AIME24/25, AMC23;
see its MANIFEST.md); the rest comes through the first two. Layout and formats are the EvalPlus releases and the AZR /
Qwen2.5-Math ``math_eval`` files;
LiveCodeBench is read from a user-supplied release jsonl (see :mod:`populora_verl.eval.lcb`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from populora_verl.eval.items import Item
from populora_verl.eval.items import read_jsonl as _read_jsonl
from populora_verl.eval.math_grader import extract_boxed

__all__ = [
    "Item",
    "BenchmarkSpec",
    "BENCHMARKS",
    "CODE_BENCHMARKS",
    "MATH_BENCHMARKS",
    "PACKAGE_DATA",
    "resolve_data_dir",
    "load_benchmark",
    "benchmark_names",
    "register_benchmark",
]


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    display: str
    kind: str  # code | math
    patterns: tuple[str, ...]  # glob patterns under the data dir, first match wins
    loader: Callable[[Path, str], list[Item]]


BENCHMARKS: dict[str, BenchmarkSpec] = {}


def register_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    """Add a benchmark to the registry (name must be new)."""
    if spec.name in BENCHMARKS:
        raise ValueError(f"benchmark {spec.name!r} is already registered")
    BENCHMARKS[spec.name] = spec
    return spec


def _require(row: dict[str, Any], keys: tuple[str, ...], path: Path) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{path}: row {row.get('task_id', row.get('id', '?'))!r} lacks fields {missing}")


# --- code -----------------------------------------------------------------------------------------------------


def _load_evalplus(dataset: str) -> Callable[[Path, str], list[Item]]:
    def load(path: Path, name: str) -> list[Item]:
        items = []
        for row in _read_jsonl(path):
            _require(row, ("task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input"), path)
            plus = row["plus_input"]
            if isinstance(plus, dict):  # Mbpp/793 stores {} for "no plus inputs"
                plus = list(plus.values())
            gold = {
                "dataset": dataset,
                "task_id": row["task_id"],
                "entry_point": row["entry_point"],
                "prompt": row["prompt"],
                "canonical_solution": row["canonical_solution"],
                "base_input": row["base_input"],
                "plus_input": plus,
                "atol": float(row.get("atol") or 0),
            }
            items.append(Item(name, row["task_id"], "code", row["prompt"], gold))
        return items

    return load


# --- math -----------------------------------------------------------------------------------------------------


def _gsm8k(path: Path, name: str) -> list[Item]:
    items = []
    for i, row in enumerate(_read_jsonl(path)):
        _require(row, ("question", "answer"), path)
        if "####" not in row["answer"]:
            raise ValueError(f"{path}: row {i} has no '####' final answer")
        gold = row["answer"].split("####")[-1].strip().replace(",", "")
        items.append(Item(name, str(row.get("idx", i)), "math", row["question"], gold))
    return items


def _answer_field(question_key: str, answer_key: str) -> Callable[[Path, str], list[Item]]:
    def load(path: Path, name: str) -> list[Item]:
        items = []
        for i, row in enumerate(_read_jsonl(path)):
            _require(row, (question_key, answer_key), path)
            gold = row[answer_key]
            if isinstance(gold, float) and gold.is_integer():
                gold = int(gold)  # AMC23 stores 27.0 for 27
            gold = str(gold).strip()
            if re.fullmatch(r"-?\d+\.0+", gold):
                gold = gold.split(".")[0]
            rid = row.get("unique_id", row.get("id", row.get("idx", i)))
            items.append(Item(name, str(rid), "math", row[question_key], gold))
        return items

    return load


def _minerva(path: Path, name: str) -> list[Item]:
    items = []
    for i, row in enumerate(_read_jsonl(path)):
        _require(row, ("problem", "solution"), path)
        gold = extract_boxed(row["solution"])  # no answer field: the Qwen harness takes the last \boxed{}
        if gold is None:
            raise ValueError(f"{path}: row {i} has no \\boxed{{}} answer in its solution")
        items.append(Item(name, str(row.get("idx", i)), "math", row["problem"], gold))
    return items


def _olympiad(path: Path, name: str) -> list[Item]:
    items = []
    for i, row in enumerate(_read_jsonl(path)):
        _require(row, ("question", "final_answer"), path)
        fa = row["final_answer"]
        gold = (fa[0] if isinstance(fa, list) and fa else str(fa)).strip().strip("$").strip()
        meta = {
            "unit": row.get("unit"),
            "answer_type": row.get("answer_type"),
            "is_multiple_answer": row.get("is_multiple_answer"),
        }
        items.append(Item(name, str(row.get("id", i)), "math", row["question"], gold, meta))
    return items


def _lcb(path: Path, name: str) -> list[Item]:
    from populora_verl.eval.lcb import load_lcb_items

    return load_lcb_items(path, name=name)


for _spec in (
    BenchmarkSpec(
        "humaneval_plus",
        "HumanEval+",
        "code",
        ("humanevalplus/*.jsonl.gz", "humanevalplus/*.jsonl"),
        _load_evalplus("humaneval"),
    ),
    BenchmarkSpec("mbpp_plus", "MBPP+", "code", ("mbppplus/*.jsonl.gz", "mbppplus/*.jsonl"), _load_evalplus("mbpp")),
    BenchmarkSpec("livecodebench", "LCB", "code", ("livecodebench/*.jsonl", "livecodebench/*.jsonl.gz"), _lcb),
    BenchmarkSpec("aime24", "AIME24", "math", ("aime24/test.jsonl*",), _answer_field("problem", "answer")),
    BenchmarkSpec("aime25", "AIME25", "math", ("aime25/test.jsonl*",), _answer_field("problem", "answer")),
    BenchmarkSpec("amc23", "AMC23", "math", ("amc23/test.jsonl*",), _answer_field("problem", "answer")),
    BenchmarkSpec("math500", "MATH500", "math", ("math500/test.jsonl*",), _answer_field("problem", "answer")),
    BenchmarkSpec("minerva_math", "Minerva", "math", ("minerva_math/test.jsonl*",), _minerva),
    BenchmarkSpec("olympiadbench", "OlympiadBench", "math", ("olympiadbench/test.jsonl*",), _olympiad),
    BenchmarkSpec("gsm8k", "GSM8K", "math", ("gsm8k/test.jsonl*",), _gsm8k),
):
    register_benchmark(_spec)

# The paper's averages (PopuLoRA lists GSM8K among its math benchmarks; AZR's math average leaves it out).
CODE_BENCHMARKS = ("humaneval_plus", "mbpp_plus", "livecodebench")
MATH_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench", "gsm8k")


def benchmark_names() -> list[str]:
    return list(BENCHMARKS)


PACKAGE_DATA = Path(__file__).resolve().with_name("benchmark_data")


def resolve_data_dir(data_dir: str | os.PathLike | None = None, name: str | None = None) -> Path:
    """The benchmark directory: ``data_dir``, else ``$POPULORA_BENCHMARKS``, else the package's own copy, which
    ships only the benchmarks whose licences allow it: with ``name``, a benchmark it lacks is an error naming the
    ways to give one."""
    if data_dir is not None:
        p = Path(data_dir)
        if not p.is_dir():
            raise FileNotFoundError(f"--data-dir: benchmark directory {p} does not exist")
        return p
    env = os.environ.get("POPULORA_BENCHMARKS")
    if env:
        p = Path(env)
        if not p.is_dir():
            raise FileNotFoundError(f"POPULORA_BENCHMARKS={env} is not a directory")
        return p
    if PACKAGE_DATA.is_dir() and (name is None or find_benchmark_file(name, PACKAGE_DATA) is not None):
        return PACKAGE_DATA
    what = f"no {name} file" if name else "no benchmark data"
    raise FileNotFoundError(
        f"{what} in {PACKAGE_DATA}: pass --data-dir or set POPULORA_BENCHMARKS (layout in docs/evaluation.md)"
    )


def find_benchmark_file(name: str, data_dir: Path) -> Path | None:
    spec = BENCHMARKS[name]
    for pattern in spec.patterns:
        hits = sorted(data_dir.glob(pattern))
        if hits:
            return hits[-1]  # several releases side by side: the last by name
    return None


def load_benchmark(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    path: str | os.PathLike | None = None,
    limit: int | None = None,
) -> list[Item]:
    """Load benchmark ``name`` (a registry key) from ``path`` or from its file under the data dir."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    if path is None:
        root = resolve_data_dir(data_dir, name)
        found = find_benchmark_file(name, root)
        if found is None:
            raise FileNotFoundError(f"{name}: no file matching {list(spec.patterns)} under {root}")
        path = found
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{name}: {path} is not a file")
    items = spec.loader(path, name)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        items = items[:limit]
    return items
