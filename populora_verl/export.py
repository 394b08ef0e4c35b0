"""``populora-export RUN_DIR MEMBER OUT``: one population member as a standard PEFT adapter folder.

The folder holds ``adapter_model.safetensors`` and ``adapter_config.json`` (with ``base_model_name_or_path``), so
``PeftModel.from_pretrained(base, OUT)`` and ``vllm serve BASE --enable-lora --lora-modules NAME=OUT`` take it as
is, plus ``populora_member.json`` (who the member is: role, rating, parents, operator, the checkpoint it came from).
RUN_DIR is a CPU-driver run (``--run-dir``) or a verl run (``trainer.default_local_dir``); the newest checkpoint
is used unless ``--step N`` is given.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["NotInRun", "export_member", "find_member_population", "checkpoint_steps", "main"]

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


class NotInRun(FileNotFoundError):
    """A step or member the run does not have; the message lists what it has (bad input, not a failure)."""


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps with a population checkpoint, CPU-driver (``checkpoints/step_N``) or verl layout."""
    run = Path(run_dir)
    steps = set()
    for ck in [*run.glob("checkpoints/step_*"), *run.glob("global_step_*/populora/checkpoints/step_*")]:
        suffix = ck.name.removeprefix("step_")
        if suffix.isdigit() and (ck / "population" / "population.json").is_file():
            steps.add(int(suffix))
    return sorted(steps)


def find_member_population(run_dir: str | Path, step: int | None = None) -> Path:
    """The ``population/`` folder of the run's newest (or step ``step``) checkpoint, CPU-driver or verl layout."""
    from populora_verl.checkpoint import latest_checkpoint
    from populora_verl.trainer.resume import tracked_folder

    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    roots = [run]
    verl_step = run / f"global_step_{step}" if step is not None else tracked_folder(run)
    if verl_step is not None:
        roots.insert(0, verl_step / "populora")  # verl: global_step_N/populora/checkpoints/step_N
    for root in roots:
        ck = root / "checkpoints" / f"step_{step}" if step is not None else latest_checkpoint(root)
        if ck is not None and (ck / "population" / "population.json").is_file():
            return ck / "population"
    steps = checkpoint_steps(run)
    if step is not None:
        raise NotInRun(
            f"--step {step}: no population checkpoint of that step under {run}; steps with one: {steps or 'none'}"
        )
    raise NotInRun(
        f"no complete population checkpoint under {run}"
        + (f"; steps with one: {steps} (pass --step)" if steps else " (not a PopuLoRA run, or none saved yet)")
    )


def export_member(
    run_dir: str | Path,
    member: str,
    out: str | Path,
    *,
    step: int | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write member ``member`` of ``run_dir`` to ``out`` as a PEFT adapter folder; returns ``out``."""
    pop_dir = find_member_population(run_dir, step)
    state = json.loads((pop_dir / "population.json").read_text(encoding="utf-8"))
    lineage = {r["id"]: r for r in state.get("lineage", [])}
    src = pop_dir / "adapters" / member
    if not (src / ADAPTER_FILES[0]).is_file():
        alive = sorted(p.name for p in (pop_dir / "adapters").iterdir()) if (pop_dir / "adapters").is_dir() else []
        why = "was replaced before this checkpoint" if member in lineage else "is not a member of this run"
        raise NotInRun(f"member {member!r} {why} ({pop_dir.parent.name}); members with an adapter: {alive}")
    config = json.loads((src / "adapter_config.json").read_text(encoding="utf-8"))
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    if not config.get("base_model_name_or_path"):
        raise ValueError(f"{src}/adapter_config.json names no base model: pass --base-model PATH")
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists: choose another folder or pass --overwrite")
        shutil.rmtree(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(src / ADAPTER_FILES[0], tmp / ADAPTER_FILES[0])
    (tmp / ADAPTER_FILES[1]).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    rec = lineage.get(member, {})
    mu_sigma = ((state.get("ratings") or {}).get("ratings") or {}).get(member)
    rating = {"mu": mu_sigma[0], "sigma": mu_sigma[1]} if mu_sigma else None
    info: dict[str, Any] = {
        "member": member,
        "run_dir": str(Path(run_dir).resolve()),
        "checkpoint": str(pop_dir.parent.resolve()),
        "lineage": rec,
        "rating": rating,
    }
    (tmp / "populora_member.json").write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.rename(out)
    return out


def serve_command(out: Path, name: str) -> str:
    config = json.loads((out / "adapter_config.json").read_text(encoding="utf-8"))
    r = int(config.get("r", 8))
    # vLLM accepts only these --max-lora-rank values: the smallest that holds the adapter's rank
    rank = next((v for v in (8, 16, 32, 64, 128, 256, 320, 512) if v >= r), r)
    return (
        f"vllm serve {config['base_model_name_or_path']} --enable-lora --lora-modules {name}={out.resolve()} "
        f"--max-lora-rank {rank}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="populora-export",
        description="Write one population member as a PEFT "
        "adapter folder (PeftModel.from_pretrained, vllm serve --lora-modules).",
    )
    p.add_argument("run_dir", help="a CPU-driver run dir or a verl trainer.default_local_dir")
    p.add_argument("member", help="member id, e.g. t0 or s3 (see population.json or the run's summary)")
    p.add_argument("out", help="folder to create")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--base-model", help="base model path or hub id to record (default: the adapter's own)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    args = p.parse_args(argv)
    from populora_verl.cli_errors import run_cli

    def run() -> int:
        from populora_verl.cli_errors import UsageError, check_output_dir, check_run_dir

        check_run_dir(args.run_dir, "run_dir", must_exist=True)
        if Path(args.out).exists() and not args.overwrite:
            raise UsageError(f"out {args.out}: exists; choose another folder or pass --overwrite")
        check_output_dir(Path(args.out).absolute().parent, "out's parent folder")
        try:
            out = export_member(
                args.run_dir,
                args.member,
                args.out,
                step=args.step,
                base_model=args.base_model,
                overwrite=args.overwrite,
            )
        except NotInRun as e:
            raise UsageError(str(e)) from None
        print(f"wrote {out}/ (adapter_model.safetensors, adapter_config.json, populora_member.json)")
        print(f"serve it: {serve_command(out, args.member)}")
        return 0

    return run_cli("populora-export", run, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
