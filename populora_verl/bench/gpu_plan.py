"""Run phases of GPU jobs on one host: the jobs of a phase at once, each on its own GPUs, phase after phase.

A 4-GPU machine can then run two 2-GPU proofs side by side instead of one after the other, and the machine is
staged once for all of them. The plan is a text file, one job per line, ``---`` between phases::

    # GPUs   name             command (bash; runs in the repo root)
    0,1,2,3  shard_check4     bash scripts/gpu/multi_gpu_proof.sh shard_check 4
    ---
    0,1      proof2_replicas  bash scripts/gpu/multi_gpu_proof.sh proof 2 replicas
    2,3      proof2_tp        bash scripts/gpu/multi_gpu_proof.sh proof 2 tp

Each job gets ``CUDA_VISIBLE_DEVICES`` = its GPUs, its own Ray instance (``RAY_ADDRESS=local``, its own
``RAY_TMPDIR``: two verl runs on one host must not join each other's cluster), ``OUT`` = ``<out>/<name>`` for its
results, and its own process group (``<out>/<name>.log`` holds its output). A failing job does not stop the plan:
the phases are independent runs. ``<out>/STOP`` (or SIGTERM) starts no further phase; SIGTERM also ends the running
jobs. Progress (phase, per-job state, exit code, wall time) is in ``<out>/progress.json``.

    python -m populora_verl.bench.gpu_plan --plan plan.txt --out /tmp/gpu_plan     # run (foreground)
    python -m populora_verl.bench.gpu_plan --status --out /tmp/gpu_plan
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from populora_verl.bench.progress import alive, read_progress, write_progress

__all__ = ["Job", "parse_plan", "run_plan", "main"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PlanError(ValueError):
    """A plan file that cannot run (one line, names the plan line)."""


@dataclasses.dataclass(frozen=True)
class Job:
    gpus: tuple[int, ...]
    name: str
    command: str


def parse_plan(text: str, *, gpu_count: int | None = None) -> list[list[Job]]:
    """Phases of jobs from a plan's text; checks names, GPU lists and that a phase's jobs share no GPU."""
    phases: list[list[Job]] = [[]]
    names: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == "---":
            phases.append([])
            continue
        parts = line.split(None, 2)
        if len(parts) < 3:
            raise PlanError(f"plan line {lineno}: want '<gpus> <name> <command>', got {line!r}")
        gpus_s, name, command = parts
        try:
            gpus = tuple(int(g) for g in gpus_s.split(","))
        except ValueError:
            raise PlanError(f"plan line {lineno}: GPUs must be comma-separated indices, got {gpus_s!r}") from None
        if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
            raise PlanError(f"plan line {lineno}: GPU list {gpus_s!r} is empty, repeats or is negative")
        if gpu_count is not None and max(gpus) >= gpu_count:
            raise PlanError(f"plan line {lineno}: GPU {max(gpus)} does not exist (this host has {gpu_count})")
        if not _NAME.match(name) or name in names:
            raise PlanError(f"plan line {lineno}: job name {name!r} is not a unique [A-Za-z0-9_.-] name")
        busy = {g for j in phases[-1] for g in j.gpus} & set(gpus)
        if busy:
            raise PlanError(f"plan line {lineno}: GPU(s) {sorted(busy)} already used by another job of this phase")
        names.add(name)
        phases[-1].append(Job(gpus, name, command))
    phases = [p for p in phases if p]
    if not phases:
        raise PlanError("plan has no job")
    return phases


def job_env(job: Job, out: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(map(str, job.gpus)),
        RAY_ADDRESS="local",
        RAY_TMPDIR=f"/tmp/ray_{job.name}",
        OUT=str(out / job.name),
        GPU_PLAN_JOB=job.name,
        PYTHONUNBUFFERED="1",
    )
    return env


def _end(procs: dict[str, subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM each running job's process group, SIGKILL what is left after ``grace_s``."""
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(p.poll() is None for p in procs.values()):
        time.sleep(0.5)
    for p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_plan(phases: Sequence[Sequence[Job]], out: Path, *, cwd: Path | None = None, poll_s: float = 2.0) -> int:
    """Run the phases; returns 0 if every job ran and exited 0."""
    out.mkdir(parents=True, exist_ok=True)
    state = {j.name: {"phase": i, "gpus": list(j.gpus), "state": "waiting"} for i, ph in enumerate(phases) for j in ph}
    write_progress(out, pid=os.getpid(), phases=len(phases), phase=None, jobs=state, state="running")
    stopping = {"flag": False}

    def _on_term(signum, frame):  # noqa: ARG001
        stopping["flag"] = True

    try:
        previous = signal.signal(signal.SIGTERM, _on_term)
    except ValueError:  # not the main thread: only the STOP file stops the plan
        previous = None
    try:
        return _run_phases(phases, out, state, stopping, cwd=cwd, poll_s=poll_s)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_phases(
    phases: Sequence[Sequence[Job]], out: Path, state: dict, stopping: dict, *, cwd: Path | None, poll_s: float
) -> int:
    for i, phase in enumerate(phases):
        if stopping["flag"] or (out / "STOP").exists():
            break
        write_progress(out, phase=i)
        procs: dict[str, subprocess.Popen] = {}
        for job in phase:
            (out / job.name).mkdir(parents=True, exist_ok=True)
            log = open(out / f"{job.name}.log", "w")
            procs[job.name] = subprocess.Popen(
                ["bash", "-c", job.command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=job_env(job, out),
                cwd=cwd,
                start_new_session=True,
            )
            log.close()
            state[job.name].update(state="running", started=time.time())
        write_progress(out, jobs=state)
        while any(p.poll() is None for p in procs.values()):
            if stopping["flag"]:
                _end(procs)
                break
            time.sleep(poll_s)
            for name, p in procs.items():
                if p.returncode is not None and state[name]["state"] == "running":
                    state[name].update(
                        state="done", rc=p.returncode, wall_s=round(time.time() - state[name]["started"], 1)
                    )
                    write_progress(out, jobs=state)
        for name, p in procs.items():
            if state[name]["state"] == "running":
                rc = p.wait()
                state[name].update(
                    state="stopped" if stopping["flag"] else "done",
                    rc=rc,
                    wall_s=round(time.time() - state[name]["started"], 1),
                )
        write_progress(out, jobs=state)
    for s in state.values():
        if s["state"] == "waiting":
            s["state"] = "not run"
    write_progress(out, jobs=state, phase=None, state="stopped" if stopping["flag"] else "finished")
    return 0 if all(s.get("rc") == 0 for s in state.values()) else 1


def status(out: Path) -> str:
    p = read_progress(out)
    if p is None:
        return f"no plan in {out}"
    running = p.get("state") == "running" and alive(p.get("pid"))
    state = p.get("state") if p.get("state") != "running" or running else "died (driver gone)"
    lines = [f"plan {state}; phase {p.get('phase')} of {p.get('phases')}"]
    now = time.time()
    for name, j in p.get("jobs", {}).items():
        t = j.get("wall_s") if j.get("wall_s") is not None else (round(now - j["started"]) if "started" in j else "-")
        lines.append(
            f"  {name:<22} phase {j['phase']} GPUs {','.join(map(str, j['gpus'])):<8} {j['state']:<8} "
            f"rc={j.get('rc', '-')} {t}s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", help="plan file (see the module docstring)")
    ap.add_argument("--status", action="store_true", help="print the progress of the plan in --out and exit")
    ap.add_argument("--gpu-count", type=int, default=None, help="check GPU indices against this count")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.status:
        print(status(out))
        return 0
    if not args.plan:
        ap.error("--plan is required unless --status")
    try:
        phases = parse_plan(Path(args.plan).read_text(), gpu_count=args.gpu_count)
    except (OSError, PlanError) as e:
        print(f"gpu_plan: {e}", file=sys.stderr)
        return 2
    return run_plan(phases, out)


if __name__ == "__main__":
    raise SystemExit(main())
