"""A run's population on disk and its lineage: where the newest population save is, its lineage records, and the
lineage tree figure. Shared by the run report (:mod:`populora_verl.eval.report`) and the metric plots
(:mod:`.plots`)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

__all__ = ["member_sort_key", "find_population_dir", "read_population", "read_lineage", "plot_lineage"]


def member_sort_key(member_id: str) -> tuple[str, float, str]:
    m = re.match(r"^([A-Za-z_]*)(\d+)$", member_id)
    return (m.group(1), float(m.group(2)), "") if m else (member_id, math.inf, member_id)


def find_population_dir(run_dir: str | Path) -> Path | None:
    """The population save of a run: ``run_dir`` itself, the ``checkpoints/latest`` step, the newest
    ``checkpoints/step_<N>``, or ``run_dir/population``."""
    run = Path(run_dir)
    if (run / "population.json").is_file():
        return run
    ck = run / "checkpoints"
    latest = ck / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        for cand in (ck / tag / "population", ck / f"step_{tag}" / "population"):
            if (cand / "population.json").is_file():
                return cand
    steps = []
    if ck.is_dir():
        for d in ck.iterdir():
            m = re.fullmatch(r"step_(\d+)", d.name)
            if m and (d / "population" / "population.json").is_file():
                steps.append((int(m.group(1)), d / "population"))
    if steps:
        return max(steps)[1]
    if (run / "population" / "population.json").is_file():
        return run / "population"
    # verl's trainer: <default_local_dir>/global_step_<N>/populora/checkpoints/step_<N>/population
    verl_steps = sorted(
        (int(m.group(1)), d)
        for d in (run.iterdir() if run.is_dir() else [])
        if (m := re.fullmatch(r"global_step_(\d+)", d.name)) and (d / "populora").is_dir()
    )
    for _, d in reversed(verl_steps):
        found = find_population_dir(d / "populora")
        if found is not None:
            return found
    return None


def read_population(pop_dir: str | Path) -> dict[str, Any]:
    path = Path(pop_dir) / "population.json"
    with open(path, encoding="utf-8") as f:
        try:
            state = json.load(f)
        except json.JSONDecodeError as e:  # the same error, naming the damaged file
            raise json.JSONDecodeError(f"{path}: {e.msg}", e.doc, e.pos) from None
    if not isinstance(state, dict) or not isinstance(state.get("lineage", []), list):
        raise ValueError(f"{pop_dir}/population.json: expected an object with a 'lineage' list")
    return state


def read_lineage(pop_dir: str | Path) -> list[dict[str, Any]]:
    """Lineage records (id, role, parents, operator, birth_step, death_step, ...), birth order."""
    recs = read_population(pop_dir).get("lineage", [])
    for r in recs:
        if "id" not in r:
            raise ValueError(f"{pop_dir}/population.json: lineage record without an id: {r}")
    return recs


def plot_lineage(lineage: Sequence[dict[str, Any]], out_path: str | Path, *, last_step: int | None = None) -> Path:
    """Lineage tree: one lane per member (teachers above students), a bar from birth to death (dashed once dead),
    and an arrow from each parent's lane to the child at its birth step, labelled with the operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    role_rank = {"teacher": 0, "both": 1, "student": 2}
    recs = sorted(lineage, key=lambda r: (role_rank.get(r.get("role"), 3), member_sort_key(r["id"])))
    lane = {r["id"]: i for i, r in enumerate(recs)}
    end = (
        last_step
        if last_step is not None
        else max([int(r.get("death_step") or 0) for r in recs] + [int(r.get("birth_step") or 0) for r in recs] + [1])
    )
    colors = {"teacher": "tab:blue", "student": "tab:orange", "both": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(7.5, 0.1 * end + 7.5), max(2.5, 0.45 * len(recs) + 1)))
    for r in recs:
        y = lane[r["id"]]
        b = int(r.get("birth_step") or 0)
        d = r.get("death_step")
        c = colors.get(r.get("role"), "tab:gray")
        ax.plot(
            [b, end if d is None else int(d)],
            [y, y],
            color=c,
            lw=2.5,
            ls="-" if d is None else "--",
            alpha=1.0 if d is None else 0.5,
        )
        ax.plot([b], [y], "o", color=c, ms=7)
        if d is not None:
            ax.plot([int(d)], [y], "x", color="black", ms=7)
        for p in r.get("parents") or []:
            if p not in lane:
                continue
            ax.annotate(
                "",
                xy=(b, y),
                xytext=(b, lane[p]),
                arrowprops=dict(arrowstyle="->", color="gray", lw=1.0, connectionstyle="arc3,rad=0.25"),
            )
        if r.get("parents"):
            # Right of the birth dot, just above the child's lane, on white so the lane line stays readable.
            ax.text(
                b + 0.12,
                y - 0.18,
                f"{r.get('operator') or '?'}({', '.join(r['parents'])})",
                fontsize=7,
                ha="left",
                va="bottom",
                color="dimgray",
                bbox=dict(facecolor="white", alpha=0.8, edgecolor="none", pad=0.5),
            )
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    roles = [k for k in colors if any(r.get("role") == k for r in recs)]
    ax.legend(
        handles=[Line2D([], [], color=colors[k], lw=2.5, label=k) for k in roles]
        + [
            Line2D([], [], color="gray", marker="o", lw=0, label="born"),
            Line2D([], [], color="gray", lw=2.5, ls="--", alpha=0.5, marker="x", mec="black", label="replaced"),
        ],
        fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    ax.set_yticks(range(len(recs)))
    ax.set_yticklabels([r["id"] for r in recs])
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_title("Population lineage: arrows parent -> child, labelled operator(parents)", fontsize=10)
    ax.set_xlim(-0.5, end + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
