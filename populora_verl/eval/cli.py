"""Console scripts ``populora-eval`` and ``populora-report``.

Keep vLLM work behind ``main()``: on GPU hosts run with ``VLLM_WORKER_MULTIPROC_METHOD=spawn``, which re-imports
the entry module in the engine process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["eval_main", "report_main", "members_from_args", "resolve_benchmarks"]


def _log(msg: str) -> None:
    print(f"[populora-eval] {msg}", file=sys.stderr, flush=True)


def resolve_benchmarks(spec: str, data_dir: str | None, lcb_path: str | None) -> list[str]:
    """``all`` | ``code`` | ``math`` | a comma list. ``all``/``code`` include LiveCodeBench only when its file is
    available (``--lcb-path`` or ``<data>/livecodebench/``); naming it explicitly without a file is an error."""
    from populora_verl.eval.data import (
        BENCHMARKS,
        CODE_BENCHMARKS,
        MATH_BENCHMARKS,
        find_benchmark_file,
        resolve_data_dir,
    )

    def has_file(name: str) -> bool:
        if name == "livecodebench" and lcb_path is not None:
            return True
        try:
            root = resolve_data_dir(data_dir, name)
        except FileNotFoundError:
            if data_dir is not None or os.environ.get("POPULORA_BENCHMARKS"):
                raise  # the user's own directory is missing: say so rather than skip everything
            return False
        return find_benchmark_file(name, root) is not None

    if spec in ("all", "code", "math"):
        names = {
            "all": list(CODE_BENCHMARKS) + list(MATH_BENCHMARKS),
            "code": list(CODE_BENCHMARKS),
            "math": list(MATH_BENCHMARKS),
        }[spec]
        missing = [n for n in names if not has_file(n)]
        if missing:
            _log(
                f"skipped (no file; pass --data-dir or, for LiveCodeBench, --lcb-path; see docs/evaluation.md): "
                f"{', '.join(BENCHMARKS[n].display for n in missing)}"
            )
        return [n for n in names if n not in missing]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; known: {sorted(BENCHMARKS)} or all/code/math")
    for n in names:  # before any model is loaded
        if n == "livecodebench" and not has_file(n):
            from populora_verl.cli_errors import UsageError

            raise UsageError(
                "--benchmarks livecodebench: no LiveCodeBench file; pass --lcb-path (the release "
                "jsonl, docs/evaluation.md) or put it under <--data-dir>/livecodebench/"
            )
        if n != "livecodebench" and not has_file(n):
            raise FileNotFoundError(
                f"{n}: no benchmark file found; pass --data-dir or set POPULORA_BENCHMARKS "
                "(layout in docs/evaluation.md)"
            )
    return names


def members_from_args(args: argparse.Namespace, *, with_adapters_file: bool = True, allow_empty: bool = False):
    """Members to evaluate: base (unless --no-base), the baseline adapter, then --adapters, --adapters-file and the
    run's population (alive members with an adapter folder)."""
    from populora_verl.diagnostics.lineage import find_population_dir, read_population
    from populora_verl.eval.backends import Member
    from populora_verl.eval.report import young_members

    members = []
    if not args.no_base:
        members.append(Member("base", None, "base"))
    if args.baseline:
        members.append(Member(args.baseline_name, args.baseline, "baseline"))
    specs = list(args.adapters or [])
    if args.adapters_file and with_adapters_file:
        specs += [
            line.strip()
            for line in Path(args.adapters_file).read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).name, spec
        members.append(Member(name, path, "member"))
    if args.run_dir:
        pop_dir = find_population_dir(args.run_dir)
        if pop_dir is None:
            raise SystemExit(f"no population.json under {args.run_dir} (checkpoints/latest, step_<N>/population)")
        state = read_population(pop_dir)
        young, window = young_members(state)
        if young:
            _log(
                f"members younger than the final quiet window ({window} steps), possibly not recovered from their "
                f"operator: {', '.join(f'{m} ({a} steps)' for m, a in young.items())}"
            )
        args.young_members, args.age_window = young, window
        alive = [r for r in state.get("lineage", []) if r.get("death_step") is None]
        for r in alive:
            folder = pop_dir / "adapters" / r["id"]
            if (folder / "adapter_config.json").is_file():
                members.append(Member(r["id"], str(folder), r.get("role", "member")))
            else:
                _log(f"member {r['id']} has no adapter folder in {pop_dir}; skipped")
    if not members and not allow_empty:
        raise SystemExit(
            "nothing to evaluate: give --run-dir, --adapters, --adapters-file or --baseline (or drop --no-base)"
        )
    return members


def _check_args(args: argparse.Namespace) -> None:
    """The flags' values and what they need on this machine, each a one-line error naming the flag (exit status
    2), before the benchmarks are read or any model loads: found after loading, they would cost the load."""
    from populora_verl.cli_errors import UsageError

    if args.limit is not None and args.limit < 1:
        raise UsageError(
            f"--limit must be >= 1 (the first N items of each benchmark), got {args.limit}; drop it for every item"
        )
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.lcb_path is not None and not Path(args.lcb_path).is_file():
        raise UsageError(f"--lcb-path {args.lcb_path}: no such file")
    if args.warm_cache:
        return  # no model, no backend
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise UsageError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib:g}")
    if args.backend == "vllm":
        from populora_verl.checks import vllm_missing

        missing = vllm_missing()
        if missing:
            raise UsageError(f"--backend vllm: {missing}; or use --backend hf")
    if args.wait is not None:
        _check_wait_args(args)


def _check_wait_args(args: argparse.Namespace) -> None:
    """--wait's needs, each a one-line error naming the flag, before anything loads."""
    from populora_verl.cli_errors import UsageError

    if not args.adapters_file:
        raise UsageError("--wait needs --adapters-file (the file awaited)")
    if args.wait <= 0:
        raise UsageError(f"--wait must be > 0 seconds, got {args.wait:g}")
    if not args.model:
        raise UsageError("--wait needs --model (the adapters that would name it are not there yet)")
    if args.backend == "vllm" and (not args.max_loras or not args.max_lora_rank):
        raise UsageError(
            "--wait with --backend vllm needs --max-loras and --max-lora-rank (the engine's LoRA slots "
            "are fixed when it starts)"
        )


def _wait_for(path: Path, timeout_s: float, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    _log(f"model ready; waiting up to {timeout_s:.0f} s for {path}")
    while not path.is_file():
        if time.monotonic() >= deadline:
            raise SystemExit(f"--adapters-file {path} did not appear within --wait {timeout_s:g} s")
        time.sleep(poll_s)


def _base_model(args: argparse.Namespace, members) -> str:
    if args.model:
        return args.model
    for m in members:
        if m.adapter:
            cfg = json.loads((Path(m.adapter) / "adapter_config.json").read_text(encoding="utf-8"))
            if cfg.get("base_model_name_or_path"):
                return cfg["base_model_name_or_path"]
    raise SystemExit("--model is required (no adapter names its base_model_name_or_path)")


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="populora-eval",
        description="Greedy pass@1 of the base model, a baseline "
        "adapter and a population of LoRA adapters on offline benchmarks.",
    )
    p.add_argument("--model", help="base model folder (default: base_model_name_or_path of the adapters)")
    p.add_argument("--run-dir", help="a PopuLoRA run directory: evaluates the latest checkpoint's alive members")
    p.add_argument("--adapters", nargs="*", help="more adapters as NAME=PATH (or PATH: name = folder name)")
    p.add_argument("--adapters-file", help="more adapters, one NAME=PATH (or PATH) per line")
    p.add_argument(
        "--wait",
        type=float,
        metavar="SECONDS",
        help="start the model first, then wait up to SECONDS for --adapters-file to appear (the engine's "
        "start overlaps the last training steps); needs --model, and with vllm --max-loras and "
        "--max-lora-rank",
    )
    p.add_argument("--max-loras", type=int, help="vllm: LoRA slots of an engine started before its adapters (--wait)")
    p.add_argument("--max-lora-rank", type=int, help="vllm: largest LoRA rank such an engine accepts (--wait)")
    p.add_argument("--baseline", help="baseline adapter folder (e.g. the AZR single agent)")
    p.add_argument("--baseline-name", default="baseline", help="the baseline's row name (default: baseline)")
    p.add_argument("--no-base", action="store_true", help="skip the base model row")
    p.add_argument("--benchmarks", default="all", help="all | code | math | comma list of names")
    p.add_argument(
        "--data-dir", help="benchmark directory (default: $POPULORA_BENCHMARKS, then the package's own copy)"
    )
    p.add_argument("--lcb-path", help="LiveCodeBench release jsonl (private tests as JSON, see docs)")
    p.add_argument(
        "--lcb-on-pickle",
        choices=("error", "public_only"),
        default="error",
        help="LiveCodeBench items whose private tests are pickled: refuse the file, or grade those on "
        "their public tests only (default: error)",
    )
    p.add_argument("--limit", type=int, help="first N items per benchmark, N >= 1 (smoke runs; default: all)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="tokens generated per answer (default: 1024)")
    p.add_argument(
        "--backend",
        choices=("vllm", "hf"),
        default="hf",
        help="hf: transformers + PEFT, CPU or GPU; vllm: multi-LoRA serving on a GPU (default: hf)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="HF backend batch size (default: 8)")
    p.add_argument(
        "--dtype", default="auto", help="model dtype, e.g. bfloat16 or float32 (default: auto, the model's own)"
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs per engine (default: 1)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="vllm: share of the GPU's memory the engine takes (default: 0.85)",
    )
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="vllm: a KV cache of this size instead of one sized by profiling the card's free memory, "
        "which another process on the same GPU (a trainer) throws off",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--workers", type=int, help="parallel sandboxed test runs (default: CPU count)")
    p.add_argument("--task-timeout", type=float, default=60.0, help="seconds per code task (EvalPlus default 60)")
    p.add_argument("--memory-mb", type=int, default=4096, help="address-space limit of a test process")
    p.add_argument("--cache-dir", help="expected-output cache (default: $POPULORA_CACHE or ~/.cache/populora_verl)")
    p.add_argument("--out", help="output folder (default: <run-dir>/eval or ./populora_eval)")
    p.add_argument(
        "--warm-cache",
        action="store_true",
        help="only compute the canonical solutions' expected outputs "
        "into the cache (no model: run it on idle CPUs before the evaluation) and exit",
    )
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return p


def eval_main(argv: Sequence[str] | None = None) -> int:
    args = eval_parser().parse_args(argv)
    from populora_verl.cli_errors import run_cli

    return run_cli("populora-eval", lambda: _warm(args) if args.warm_cache else _eval(args), debug=args.debug)


def _warm(args: argparse.Namespace) -> int:
    from populora_verl.cli_errors import check_output_dir
    from populora_verl.eval.evaluate import default_cache_dir, warm_expected_cache

    _check_args(args)
    cache = check_output_dir(args.cache_dir or default_cache_dir(), "--cache-dir")
    benches = resolve_benchmarks(args.benchmarks, args.data_dir, args.lcb_path)
    n = warm_expected_cache(
        benches, data_dir=args.data_dir, limit=args.limit, cache_dir=cache, workers=args.workers, log=_log
    )
    _log(f"expected outputs of {n} code tasks cached in {cache}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from populora_verl.cli_errors import check_model_path, check_output_dir, check_run_dir
    from populora_verl.eval.backends import build_backend
    from populora_verl.eval.evaluate import default_cache_dir, evaluate
    from populora_verl.eval.report import markdown_table, population_table, write_table
    from populora_verl.eval.sandbox import SandboxLimits

    # Every flag and path before the benchmarks are read and the model loads: a mistake found after generating and
    # grading would throw the whole evaluation away.
    _check_args(args)
    if args.run_dir:
        check_run_dir(args.run_dir, "--run-dir", must_exist=True)
    out = check_output_dir(args.out or (Path(args.run_dir) / "eval" if args.run_dir else "populora_eval"), "--out")
    if args.model:
        check_model_path(args.model, "--model")
    benches = resolve_benchmarks(args.benchmarks, args.data_dir, args.lcb_path)
    if args.wait is not None:
        # the members known now (base, baseline); the adapters file's come after the model is up
        members = members_from_args(args, with_adapters_file=False, allow_empty=True)
        model = args.model
    else:
        members = members_from_args(args)
        model = _base_model(args, members)
    if not args.model:  # the adapters' own base model: a folder that has moved is found here, not after loading
        check_model_path(model, "--model (from the adapters' base_model_name_or_path)")
    _log(f"model {model}; members {[m.name for m in members]}; benchmarks {benches}; backend {args.backend}")
    if args.backend == "vllm":
        kw = dict(
            max_new_tokens=args.max_new_tokens,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
            enforce_eager=args.enforce_eager,
            lora_slots=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            extra=None if args.kv_cache_gib is None else {"kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)},
        )
    else:
        kw = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, dtype=args.dtype)
    backend = build_backend(args.backend, model, members, **kw)
    if args.wait is not None:
        _wait_for(Path(args.adapters_file), args.wait)
        members = members_from_args(args)
        _log(f"members {[m.name for m in members]}")
        backend.prepare(members)
    paths = {"livecodebench": args.lcb_path} if args.lcb_path else None
    limits = SandboxLimits(memory_mb=args.memory_mb, task_timeout_s=args.task_timeout)
    results = evaluate(
        backend,
        members,
        benches,
        data_dir=args.data_dir,
        limit=args.limit,
        paths=paths,
        limits=limits,
        cache_dir=args.cache_dir or default_cache_dir(),
        workers=args.workers,
        samples_path=out / "samples.jsonl",
        log=_log,
        lcb_on_pickle=args.lcb_on_pickle,
        info={
            "model": model,
            "backend": args.backend,
            "max_new_tokens": args.max_new_tokens,
            "young_members": getattr(args, "young_members", {}),
            "age_window": getattr(args, "age_window", None),
        },
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    files = write_table(results, out)
    print(markdown_table(population_table(results)))
    _log(f"wrote {out / 'results.json'}, {files['md']}, {files['csv']}, {files['json']}, {out / 'samples.jsonl'}")
    return 0


def _check_is_run(run: Path) -> None:
    """A folder with none of a run's files would get an empty report and exit 0, as if all were well."""
    from populora_verl.cli_errors import UsageError
    from populora_verl.diagnostics.lineage import find_population_dir

    if (
        not (run / "metrics.jsonl").is_file()
        and not (run / "eval" / "results.json").is_file()
        and find_population_dir(run) is None
    ):
        raise UsageError(
            f"run directory {run}: not a PopuLoRA run (no metrics.jsonl, population checkpoint or eval/results.json)"
        )


def _read_json(path: str, flag: str) -> object:
    """A JSON file a flag names: a missing or garbled one is named with the flag, not as a bare errno."""
    from populora_verl.cli_errors import UsageError

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path}: not a UTF-8 JSON file") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def report_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="populora-report",
        description="Markdown report of a PopuLoRA run: evaluation "
        "table, training-dynamics plots, ratings and the lineage tree; or, with --compare, "
        "several runs drawn together (one figure per quantity).",
    )
    p.add_argument(
        "run_dir",
        nargs="?",
        help="the run directory to report on (a CPU-driver --run-dir or a verl "
        "trainer.default_local_dir); the report goes to <run_dir>/report unless --out",
    )
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="draw these runs on shared axes instead")
    p.add_argument("--labels", nargs="+", help="--compare: one legend label per run (default: folder names)")
    p.add_argument("--out", help="output folder (default: <run_dir>/report, or ./populora_compare)")
    p.add_argument("--eval", dest="eval_results", help="results.json of populora-eval (default: <run_dir>/eval/)")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    args = p.parse_args(argv)
    from populora_verl.cli_errors import run_cli

    if not args.run_dir and not args.compare:
        p.error("give a run directory, or --compare RUN_DIR [RUN_DIR ...]")

    def report() -> int:
        from populora_verl.eval.report import build_compare_report, build_run_report

        if args.compare:
            from populora_verl.cli_errors import check_output_dir, check_run_dir

            runs = ([args.run_dir] if args.run_dir else []) + list(args.compare)
            for run in runs:
                check_run_dir(run, "--compare", must_exist=True)
            check_output_dir(args.out or "populora_compare", "--out")
            print(build_compare_report(runs, args.out or "populora_compare", labels=args.labels))
            return 0
        from populora_verl.cli_errors import check_output_dir, check_run_dir

        check_run_dir(args.run_dir, "run directory", must_exist=True)
        if not args.eval_results:  # with --eval, the evaluation alone makes a report
            _check_is_run(Path(args.run_dir))
        check_output_dir(args.out or Path(args.run_dir) / "report", "--out")
        results = _read_json(args.eval_results, "--eval") if args.eval_results else None
        path = build_run_report(args.run_dir, args.out, eval_results=results)
        print(path)
        return 0

    return run_cli("populora-report", report, debug=args.debug)


if __name__ == "__main__":
    sys.exit(eval_main())
