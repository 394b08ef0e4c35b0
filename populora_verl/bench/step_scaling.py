"""Step-time and GPU-memory scaling of the verl trainer with population size.

    python -m populora_verl.bench.step_scaling --model /path/to/qwen-coder-0.5b [--steps 4] [--out DIR]

Runs ``python -m verl.trainer.main_ppo`` with the ``smoke_0.5b`` recipe once per configuration, in this process's
GPU(s), one after another: the single agent (AZR baseline, 1 adapter), 1T1S, 2T2S and 4T4S. Every adapter gets the
same per-step budget (``proposals_per_type`` x task types teacher prompts, ``student_n`` answers per task), so a
population's step does N times the single agent's generation and update work. Evolution and checkpoints are off
(they are not per-step costs). Reported per configuration:

* seconds per step (``timing_s/step``), mean over steps 2..N (step 1 pays for warm-up/compilation), and the same
  mean for the step's phases (generation, validation, scoring, old log-probs, update, weight sync);
* peak GPU memory: the maximum of ``nvidia-smi`` polled every 0.5 s over the run (vLLM and the FSDP worker are
  separate processes, so a single process's ``torch.cuda.max_memory_allocated`` would miss most of it), and verl's
  ``actor/perf/max_memory_allocated_gb`` (the trainer worker's own peak);
* ratios against the single agent, and per adapter (seconds per step / number of adapters).

Metrics are read from verl's ``file`` logger (one JSON line per step, ``VERL_FILE_LOGGER_PATH``), with verl's console
lines in the run's log as the fallback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "populora"
CONFIGS: dict[str, list[str]] = {
    "single": ["populora.population.mode=single_agent", "populora.pbt.enabled=false"],
    "1t1s": ["populora.population.num_teachers=1", "populora.population.num_students=1"],
    "2t2s": ["populora.population.num_teachers=2", "populora.population.num_students=2"],
    "4t4s": ["populora.population.num_teachers=4", "populora.population.num_students=4"],
}
ADAPTERS = {"single": 1, "1t1s": 2, "2t2s": 4, "4t4s": 8}
# verl's console logger line, possibly behind Ray's "(TaskRunnerV1 pid=...)" prefix.
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - ")
_METRIC = re.compile(r"([\w/@.\-]+):([-+0-9.eE]+|nan|inf)")
# Step phases worth a column: verl's and ours (trainer.step's marked_timer names).
PHASES = ("gen", "populora_validate", "populora_score", "old_log_prob", "update_actor", "update_weights")


@dataclass
class RunResult:
    name: str
    adapters: int
    rc: int
    wall_s: float
    step_s: dict[int, float] = field(default_factory=dict)
    verl_peak_gb: float | None = None
    smi_peak_mib: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)

    @property
    def mean_step_s(self) -> float | None:
        steady = [v for k, v in self.step_s.items() if k >= 2]
        return sum(steady) / len(steady) if steady else None


Figures = tuple[dict[int, float], float | None, dict[str, float]]


def summarize(rows: Iterable[tuple[int, Mapping[str, Any]]]) -> Figures:
    """``{step: timing_s/step}``, the max trainer peak memory and the mean (steps >= 2) of each phase's
    ``timing_s/<phase>`` from ``(step, metrics)`` rows. verl logs the worker's peak as
    ``actor/perf/max_memory_allocated_gb`` and we add ``populora/<member>/actor/perf/...`` per adapter."""
    steps, peak, phases = {}, None, {}
    for step, data in rows:
        num = {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
        if "timing_s/step" in num:
            steps[step] = num["timing_s/step"]
        mem = [v for k, v in num.items() if k.endswith("perf/max_memory_allocated_gb")]
        if mem:
            peak = max(peak or 0.0, *mem)
        if step >= 2:
            for ph in PHASES:
                if f"timing_s/{ph}" in num:
                    phases.setdefault(ph, []).append(num[f"timing_s/{ph}"])
    return steps, peak, {ph: sum(v) / len(v) for ph, v in phases.items()}


def file_log_rows(text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(step, metrics)`` from verl's ``file`` logger (``{"step": n, "data": {...}}`` per line); a torn last line
    (a killed run) is skipped."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
            yield int(row["step"]), dict(row["data"])
        except (ValueError, KeyError, TypeError):
            continue


def console_rows(text: str) -> Iterator[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` from verl's console logger lines (possibly behind Ray's actor prefix)."""
    for line in text.splitlines():
        m = _STEP_LINE.search(line)
        if m:
            yield int(m.group(1)), {k: float(v) for k, v in _METRIC.findall(line)}


class GpuMemoryPoller:
    """Peak ``memory.used`` (MiB, summed over visible GPUs) from ``nvidia-smi``, polled in a thread."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s, self.peak, self._stop = interval_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        vals = [float(x) for x in out.stdout.split() if x.strip().replace(".", "", 1).isdigit()]
        return sum(vals) if vals else None

    def _run(self) -> None:
        while not self._stop.is_set():
            v = self._sample()
            if v is not None:
                self.peak = max(self.peak, v)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuMemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def command(model: str, name: str, steps: int, out_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name", "smoke_0.5b",
            f"actor_rollout_ref.model.path={model}", "trainer.logger=[console,file]", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=-1", "trainer.resume_mode=disable", "populora.pbt.enabled=false",
            f"trainer.default_local_dir={out_dir / name / 'ckpt'}",
            "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            *CONFIGS[name], *extra]


def run_one(model: str, name: str, steps: int, out_dir: Path, extra: list[str], timeout_s: int) -> RunResult:
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_USE_FLASHINFER_SAMPLER="0",
               RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               VERL_FILE_LOGGER_PATH=str(out_dir / f"{name}.metrics.jsonl"))
    log = out_dir / f"{name}.log"
    t0 = time.time()
    with GpuMemoryPoller() as poller, open(log, "w") as f:
        try:
            rc = subprocess.run(command(model, name, steps, out_dir, extra), stdout=f, stderr=subprocess.STDOUT,
                                env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.time() - t0
    step_s, verl_peak, phases = read_results(out_dir, name)
    return RunResult(name, ADAPTERS[name], rc, wall, step_s, verl_peak, poller.peak or None, phases)


def read_results(out_dir: Path, name: str) -> Figures:
    """A configuration's figures from its file-logger output, else from its console log."""
    for path, rows in ((out_dir / f"{name}.metrics.jsonl", file_log_rows), (out_dir / f"{name}.log", console_rows)):
        if path.exists():
            found = summarize(rows(path.read_text(errors="replace")))
            if found[0]:
                return found
    return {}, None, {}


def report(results: list[RunResult]) -> str:
    base = next((r for r in results if r.name == "single" and r.mean_step_s), None)
    lines = ["| config | adapters | s/step (steps 2..N) | x single | s/step/adapter | peak GPU MiB (nvidia-smi) | "
             "x single | trainer peak GiB (verl) | exit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r.mean_step_s
        ratio = f"{s / base.mean_step_s:.2f}" if s and base else "-"
        mem_ratio = f"{r.smi_peak_mib / base.smi_peak_mib:.2f}" if r.smi_peak_mib and base and base.smi_peak_mib else "-"
        lines.append(f"| {r.name} | {r.adapters} | {s:.1f} | {ratio} | {s / r.adapters:.1f} | "
                     f"{r.smi_peak_mib or float('nan'):.0f} | {mem_ratio} | {r.verl_peak_gb or float('nan'):.2f} | {r.rc} |"
                     if s else f"| {r.name} | {r.adapters} | - | - | - | {r.smi_peak_mib or '-'} | - | - | {r.rc} |")
    phase_rows = [r for r in results if r.phases_s]
    if phase_rows:
        cols = [ph for ph in PHASES if any(ph in r.phases_s for r in phase_rows)]
        lines += ["", "| config | " + " | ".join(f"{c} s" for c in cols) + " |", "|---|" + "---|" * len(cols)]
        lines += [f"| {r.name} | " + " | ".join(f"{r.phases_s[c]:.1f}" if c in r.phases_s else "-" for c in cols) + " |"
                  for r in phase_rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (e.g. Qwen2.5-Coder-0.5B-Instruct)")
    ap.add_argument("--steps", type=int, default=4, help="steps per configuration (step 1 is excluded as warm-up)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--out", default="bench_step_scaling", help="folder for logs and results.json")
    ap.add_argument("--timeout-s", type=int, default=1800, help="per configuration")
    ap.add_argument("overrides", nargs="*", help="extra hydra overrides for every run")
    args = ap.parse_args(argv)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        print("step_scaling: needs a CUDA GPU (verl's FSDP engine and vLLM do not run on CPU); nothing was run.",
              file=sys.stderr)
        return 2
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is warm-up)")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Results of earlier invocations with the same --out are kept (a config run again replaces its row), so the
    # configurations can be split over several calls on one machine and still be compared in one table.
    results: list[RunResult] = []
    prev = out / "results.json"
    if prev.exists():
        for row in json.loads(prev.read_text()):
            row.pop("mean_step_s", None)
            row["step_s"] = {int(k): v for k, v in row.get("step_s", {}).items()}
            if row["name"] not in names:
                r = RunResult(**row)
                found = read_results(out, r.name)  # re-read with the current parser
                if found[0]:
                    r.step_s, r.verl_peak_gb, r.phases_s = found
                results.append(r)
    from tqdm.auto import tqdm

    bar = tqdm(names, desc="step_scaling", unit="config", disable=None)
    say = bar.write if not bar.disable else (lambda s: print(s, flush=True))
    for name in bar:
        say(f"step_scaling: {name} ({ADAPTERS[name]} adapters, {args.steps} steps) ...")
        r = run_one(args.model, name, args.steps, out, list(args.overrides), args.timeout_s)
        say(f"  exit={r.rc} wall={r.wall_s:.0f}s steps={r.step_s} peak={r.smi_peak_mib} MiB")
        results.append(r)
    (out / "results.json").write_text(json.dumps([asdict(r) | {"mean_step_s": r.mean_step_s} for r in results],
                                                 indent=1))
    results.sort(key=lambda r: list(CONFIGS).index(r.name))
    table = report(results)
    print(table)
    (out / "results.md").write_text(table + "\n")
    return 0 if all(r.rc == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
