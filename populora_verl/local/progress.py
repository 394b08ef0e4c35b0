"""What the CPU driver tells the user: one line per step, and what a run on the tiny model can and cannot show."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["step_line", "TINY_MODEL_NOTE", "files_written"]

TINY_MODEL_NOTE = (
    "note: this ran the embedded tiny random model. It writes garbage, so validity, solve counts and coverage stay 0 "
    "on every run; that is expected. What it shows is the loop itself: every member generates under its own "
    "adapter, invalid proposals get the format penalty, students fall back to buffer tasks, ratings move and "
    "evolution replaces the weakest member of each role. Learning needs a real model (--model DIR here, or a GPU "
    "recipe, which is far faster): docs/models.md says which size learns, docs/recipes.md which recipe fits your GPUs."
)


def step_line(
    step: int, total: int, result: Any, metrics: Mapping[str, float], population: Any, plan: Any = None
) -> str:
    """``step 2/3 | teachers: 1/8 proposals valid | students: 3/16 solved (8 on buffer tasks) | mu t0 21.3 ... |
    evolved t1->t2 (neftune)``: counts a user can follow step by step."""
    teacher = [s for s in result.samples if s.role == "teacher"]
    student = [s for s in result.samples if s.role == "student"]
    valid = sum(s.meta.get("status") == "valid" for s in teacher)
    solved = sum(bool(s.meta.get("correct")) for s in student)
    buffer = sum(s.meta.get("source") == "buffer" for s in student)
    parts = [f"step {step}/{total}"]
    if teacher:
        parts.append(f"teachers: {valid}/{len(teacher)} proposals valid")
    parts.append(f"students: {solved}/{len(student)} solved" + (f" ({buffer} on buffer tasks)" if buffer else ""))
    ratings = " ".join(
        f"{m.id} {metrics.get(f'populora/rating/{m.id}/mu', population.ratings[m.id].mu):.1f}"
        for m in population.members
    )
    parts.append(f"mu {ratings}")
    if plan is not None and getattr(plan, "replacements", None):
        parts.append("evolved " + ", ".join(f"{r.victim_id}->{r.child_id} ({r.operator})" for r in plan.replacements))
    return " | ".join(parts)


def files_written(run_dir: Path) -> list[str]:
    """The run directory's outputs that exist, as ``path  (what it is)`` lines for the final summary."""
    items: Sequence[tuple[str, str]] = [
        ("config.yaml", "the resolved config"),
        ("metrics.jsonl", "one JSON line per step"),
        ("tb", "TensorBoard scalars: tensorboard --logdir"),
        ("evolution.jsonl", "evolution events"),
        ("base_model", "the tiny base model the adapters refer to"),
    ]
    out = [f"  {run_dir / name}  ({what})" for name, what in items if (run_dir / name).exists()]
    plots = sorted((run_dir / "plots").glob("*.png")) if (run_dir / "plots").is_dir() else []
    if plots:
        out.append(f"  {run_dir / 'plots'}/  ({', '.join(p.name for p in plots)})")
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        out.append(
            f"  {run_dir / 'checkpoints' / latest.read_text().strip()}  (latest checkpoint; PEFT folders "
            "under population/adapters/)"
        )
    return out
