"""Greedy pass@1 of several members on several benchmarks: generate once, grade everything.

All prompts of all benchmarks go to the backend in one call (one vLLM batch over every member). Code is graded
in sandboxed child processes on a thread pool (threads only wait on children); math is graded in the main
thread so math-verify's ``signal.alarm`` timeouts work.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from populora_verl.eval.backends import GenerationBackend, Member
from populora_verl.eval.code_grader import CodeResult, Expected, check_candidate, compute_expected, extract_code
from populora_verl.eval.data import Item, find_benchmark_file, load_benchmark, resolve_data_dir
from populora_verl.eval.lcb import check_lcb, load_lcb_items
from populora_verl.eval.math_grader import score_math
from populora_verl.eval.prompts import messages_for, render_prompt
from populora_verl.eval.sandbox import DEFAULT_LIMITS, SandboxLimits

__all__ = ["RESULTS_FORMAT", "load_items", "grade", "evaluate", "default_cache_dir"]

RESULTS_FORMAT = "populora.eval/1"


def default_cache_dir() -> Path:
    root = os.environ.get("POPULORA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "populora_verl")
    return Path(root) / "eval"


def load_items(
    benchmarks: Sequence[str],
    *,
    data_dir: str | None = None,
    limit: int | None = None,
    paths: dict[str, str] | None = None,
    lcb_on_pickle: str = "error",
) -> dict[str, list[Item]]:
    """Items per benchmark; ``paths`` overrides a benchmark's file, ``lcb_on_pickle`` is passed to the LCB loader."""
    paths = paths or {}
    out = {}
    for b in benchmarks:
        if b == "livecodebench" and lcb_on_pickle != "error":
            path = paths.get(b) or find_benchmark_file(b, resolve_data_dir(data_dir, b))
            if path is None:
                raise FileNotFoundError("livecodebench: no file (pass its path)")
            out[b] = load_lcb_items(path, on_pickle=lcb_on_pickle)[:limit]
        else:
            out[b] = load_benchmark(b, data_dir, path=paths.get(b), limit=limit)
    return out


def _grade_code(item: Item, text: str, expected: Expected | None, limits: SandboxLimits) -> dict[str, Any]:
    gold = item.gold
    entry = gold.get("func_name") if gold["dataset"] == "lcb" else gold["entry_point"]
    code = extract_code(text, entry)
    if gold["dataset"] == "lcb":
        ok, err = check_lcb(gold, code, limits=limits)
        return {"correct": ok, "error": err}
    res: CodeResult = check_candidate(gold, code, expected, limits=limits)
    return {"correct": res.plus_pass, "base_correct": res.base_pass, "error": res.error}


def expected_outputs(
    items_by_bench: dict[str, list[Item]],
    *,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict[tuple[str, str], Expected]:
    """The canonical solutions' outputs for every HumanEval+/MBPP+ item, ``{(benchmark, id): Expected}``, from
    ``cache_dir`` where present (else computed and stored there)."""
    workers = workers or max(1, os.cpu_count() or 1)
    code_items = [
        it for items in items_by_bench.values() for it in items if it.kind == "code" and it.gold["dataset"] != "lcb"
    ]
    expected: dict[tuple[str, str], Expected] = {}
    if code_items:
        t0 = time.time()
        with ThreadPoolExecutor(workers) as pool:
            results = pool.map(lambda it: compute_expected(it.gold, cache_dir=cache_dir), code_items)
            for it, exp in zip(
                code_items, tqdm(results, total=len(code_items), desc="expected outputs", unit="task", disable=None)
            ):
                expected[(it.benchmark, it.id)] = exp
                if exp.error:
                    log(f"warning: {it.id}: {exp.error}")
        log(f"expected outputs for {len(code_items)} code tasks in {time.time() - t0:.1f}s")
    return expected


def warm_expected_cache(
    benchmarks: Sequence[str],
    *,
    data_dir: str | None = None,
    limit: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> int:
    """Fill the expected-output cache for ``benchmarks`` ahead of an evaluation (no model needed): on a GPU
    machine this runs on idle CPUs while training, so the evaluation does not wait for it. Returns the number of
    code tasks whose outputs are now cached."""
    items = load_items(benchmarks, data_dir=data_dir, limit=limit)
    got = expected_outputs(items, cache_dir=cache_dir, workers=workers, log=log)
    return sum(1 for e in got.values() if e.error is None)


def grade(
    items_by_bench: dict[str, list[Item]],
    completions: dict[str, dict[str, list[str]]],
    *,
    limits: SandboxLimits = DEFAULT_LIMITS,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict[str, Any]]:
    """Grade ``completions[member][benchmark][k]`` (the k-th item's response). Returns one record per
    (member, benchmark, item): ``correct`` (HumanEval+/MBPP+: plus tests), ``base_correct`` for EvalPlus sets,
    the extracted ``answer`` (math) and an ``error`` note."""
    workers = workers or max(1, os.cpu_count() or 1)
    records: list[dict[str, Any]] = []
    expected = expected_outputs(items_by_bench, cache_dir=cache_dir, workers=workers, log=log)
    jobs = []
    for member, by_bench in completions.items():
        for bench, items in items_by_bench.items():
            texts = by_bench[bench]
            if len(texts) != len(items):
                raise ValueError(f"{member}/{bench}: {len(texts)} completions for {len(items)} items")
            for it, text in zip(items, texts):
                jobs.append((member, it, text))
    code_jobs = [j for j in jobs if j[1].kind == "code"]
    with ThreadPoolExecutor(workers) as pool:
        code_out = list(
            tqdm(
                pool.map(lambda j: _grade_code(j[1], j[2], expected.get((j[1].benchmark, j[1].id)), limits), code_jobs),
                total=len(code_jobs),
                desc="grade code",
                unit="answer",
                disable=None,
            )
        )
    for (member, it, text), res in zip(code_jobs, code_out):
        records.append({"member": member, "benchmark": it.benchmark, "id": it.id, **res, "completion": text})
    for member, it, text in tqdm(
        jobs, desc="grade math", unit="answer", disable=None if any(j[1].kind == "math" for j in jobs) else True
    ):
        if it.kind == "math":
            ok, pred = score_math(text, it.gold)
            records.append(
                {
                    "member": member,
                    "benchmark": it.benchmark,
                    "id": it.id,
                    "correct": ok,
                    "answer": pred,
                    "gold": it.gold,
                    "completion": text,
                }
            )
    return records


def summarize(records: list[dict[str, Any]], members: Sequence[Member], benchmarks: Sequence[str]) -> dict:
    """Per member and benchmark: pass@1 (mean correctness), n, base_pass@1 for the EvalPlus sets, and ``outcomes``
    (0/1 per item, in item order, the same for every member) for the report's paired bootstrap intervals."""
    scores: dict[str, dict[str, dict[str, Any]]] = {m.name: {} for m in members}
    for m in members:
        for b in benchmarks:
            rs = [r for r in records if r["member"] == m.name and r["benchmark"] == b]
            if not rs:
                continue
            s: dict[str, Any] = {"n": len(rs), "correct": sum(bool(r["correct"]) for r in rs)}
            s["pass@1"] = s["correct"] / s["n"]
            s["outcomes"] = [int(bool(r["correct"])) for r in rs]
            if any("base_correct" in r for r in rs):
                s["base_pass@1"] = sum(bool(r.get("base_correct")) for r in rs) / len(rs)
            scores[m.name][b] = s
    return scores


def evaluate(
    backend: GenerationBackend,
    members: Sequence[Member],
    benchmarks: Sequence[str],
    *,
    data_dir: str | None = None,
    limit: int | None = None,
    paths: dict[str, str] | None = None,
    limits: SandboxLimits = DEFAULT_LIMITS,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    samples_path: str | os.PathLike | None = None,
    info: dict[str, Any] | None = None,
    log: Callable[[str], None] = lambda s: None,
    lcb_on_pickle: str = "error",
) -> dict[str, Any]:
    """Generate greedily for every member on every benchmark item and grade. Returns the results document
    (``format``, ``members``, ``benchmarks``, ``scores[member][benchmark]``, run info); writes per-sample
    records to ``samples_path`` (jsonl) when given."""
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise ValueError(f"member names must be unique, got {names}")
    items = load_items(benchmarks, data_dir=data_dir, limit=limit, paths=paths, lcb_on_pickle=lcb_on_pickle)
    order = [(b, k) for b in benchmarks for k in range(len(items[b]))]
    prompts = [render_prompt(backend.tokenizer, messages_for(items[b][k])) for b, k in order]
    log(f"generating {len(prompts)} prompts x {len(members)} members")
    t0 = time.time()
    texts = backend.generate(prompts, members)
    gen_s = time.time() - t0
    completions = {m: {b: [] for b in benchmarks} for m in names}
    for m in names:
        for (b, _), text in zip(order, texts[m]):
            completions[m][b].append(text)
    t1 = time.time()
    records = grade(items, completions, limits=limits, cache_dir=cache_dir, workers=workers, log=log)
    if samples_path is not None:
        Path(samples_path).parent.mkdir(parents=True, exist_ok=True)
        with open(samples_path, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, default=str) + "\n")
    return {
        "format": RESULTS_FORMAT,
        "members": [{"name": m.name, "adapter": m.adapter, "role": m.role} for m in members],
        "benchmarks": list(benchmarks),
        "limit": limit,
        "scores": summarize(records, members, benchmarks),
        "timing_s": {"generate": round(gen_s, 2), "grade": round(time.time() - t1, 2)},
        **(info or {}),
    }
