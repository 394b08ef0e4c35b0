"""PNG plots of a run's metrics log (``<run_dir>/metrics.jsonl``).

``python -m populora_verl.diagnostics.plots <run_dir> [--out <dir>]`` writes every plot the log has data for into
``<run_dir>/plots`` (default). A plot whose keys are absent from the log is skipped with a logged note.

matplotlib is imported lazily and used through its object API with the Agg canvas, so plotting neither needs a
display nor changes the process-wide pyplot backend of the caller.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from populora_verl.diagnostics.metrics import PREFIX, read_metrics

__all__ = [
    "series",
    "plot_solve_rates",
    "plot_validity",
    "plot_complexity",
    "plot_coverage",
    "plot_ratings",
    "plot_all",
    "PLOTS",
]

logger = logging.getLogger(__name__)

Rows = Sequence[Mapping[str, float]]

_PAIR = re.compile(rf"^{PREFIX}/pair/([^/]+)/([^/]+)/solve_rate$")
_VALIDITY = re.compile(rf"^{PREFIX}/validity/([^/]+)$")
_COMPLEXITY = re.compile(rf"^{PREFIX}/complexity/([^/]+)/mean$")
_RATING_MU = re.compile(rf"^{PREFIX}/rating/([^/]+)/mu$")


def _rows(metrics: str | os.PathLike | Rows) -> list[Mapping[str, float]]:
    if isinstance(metrics, (str, os.PathLike)):
        return read_metrics(metrics)
    return list(metrics)


def series(rows: Rows, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that carry ``key``."""
    steps, values = [], []
    for row in rows:
        if key in row and "step" in row:
            steps.append(float(row["step"]))
            values.append(float(row[key]))
    return steps, values


def _matching(rows: Rows, pattern: re.Pattern) -> dict[str, tuple[str, ...]]:
    """Every key of the log matching ``pattern`` -> its captured groups, in first-seen order."""
    found: dict[str, tuple[str, ...]] = {}
    for row in rows:
        for key in row:
            if key not in found:
                m = pattern.match(key)
                if m:
                    found[key] = m.groups()
    return found


def member_sort_key(member_id: str) -> tuple[str, float, str]:
    m = re.match(r"^([A-Za-z_]*)(\d+)$", member_id)
    return (m.group(1), float(m.group(2)), "") if m else (member_id, math.inf, member_id)


def _new_figure(nrows: int = 1, ncols: int = 1, width: float = 8.0, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Any, out_path: Path) -> Path:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, format="png")
    return out_path


def _skip(name: str, what: str) -> None:
    logger.info("plot %s skipped: the metrics log has no %s", name, what)


def _legend(ax: Any, n: int) -> None:
    if n:
        ax.legend(fontsize="small", ncol=max(1, math.ceil(n / 12)), loc="best")


# --- individual plots ------------------------------------------------------------------------------------------


def plot_solve_rates(metrics: str | os.PathLike | Rows, out_path: str | os.PathLike) -> Path | None:
    """Solve rate of every (teacher, student) pair over steps."""
    rows = _rows(metrics)
    keys = _matching(rows, _PAIR)
    if not keys:
        _skip("solve_rates", f"'{PREFIX}/pair/<teacher>/<student>/solve_rate' keys")
        return None
    fig, (ax,) = _new_figure()
    for key, (teacher, student) in sorted(keys.items(), key=lambda kv: tuple(map(member_sort_key, kv[1]))):
        ax.plot(*series(rows, key), marker=".", linewidth=1, label=f"{teacher} -> {student}")
    ax.set(title="Student solve rate per (teacher, student) pair", xlabel="step", ylabel="solve rate",
           ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    _legend(ax, len(keys))
    return _save(fig, Path(out_path))


def plot_validity(metrics: str | os.PathLike | Rows, out_path: str | os.PathLike) -> Path | None:
    """Valid-proposal rate per teacher over steps (mean over teachers dashed)."""
    rows = _rows(metrics)
    keys = {k: g for k, g in _matching(rows, _VALIDITY).items() if g[0] != "mean"}
    mean_key = f"{PREFIX}/validity/mean"
    has_mean = any(mean_key in r for r in rows)
    if not keys and not has_mean:
        _skip("validity", f"'{PREFIX}/validity/<teacher>' keys")
        return None
    fig, (ax,) = _new_figure()
    for key, (teacher,) in sorted(keys.items(), key=lambda kv: member_sort_key(kv[1][0])):
        ax.plot(*series(rows, key), marker=".", linewidth=1, label=teacher)
    if has_mean:
        ax.plot(*series(rows, mean_key), color="black", linestyle="--", linewidth=2, label="mean")
    ax.set(title="Valid proposals per teacher", xlabel="step", ylabel="valid / proposals", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    _legend(ax, len(keys) + has_mean)
    return _save(fig, Path(out_path))


def plot_complexity(metrics: str | os.PathLike | Rows, out_path: str | os.PathLike) -> Path | None:
    """Mean of each complexity descriptor over the step's valid tasks, one panel per descriptor."""
    rows = _rows(metrics)
    keys = _matching(rows, _COMPLEXITY)
    if not keys:
        _skip("complexity", f"'{PREFIX}/complexity/<descriptor>/mean' keys")
        return None
    fig, axes = _new_figure(1, len(keys), width=5.0)
    for ax, (key, (descriptor,)) in zip(axes, keys.items()):
        ax.plot(*series(rows, key), marker=".", linewidth=1)
        ax.set(title=f"{descriptor} (mean over valid tasks)", xlabel="step", ylabel=descriptor)
        ax.grid(alpha=0.3)
    return _save(fig, Path(out_path))


def plot_coverage(metrics: str | os.PathLike | Rows, out_path: str | os.PathLike) -> Path | None:
    """Fraction of CVT cells filled: cumulative and over the recent window."""
    rows = _rows(metrics)
    cumulative, window = f"{PREFIX}/coverage/fraction", f"{PREFIX}/coverage/window_fraction"
    present = [k for k in (cumulative, window) if any(k in r for r in rows)]
    if not present:
        _skip("coverage", f"'{cumulative}' key")
        return None
    fig, (ax,) = _new_figure()
    labels = {cumulative: "cumulative", window: "last W steps"}
    for key in present:
        ax.plot(*series(rows, key), marker=".", linewidth=1.5, label=labels[key])
    ax.set(title="Problem-space coverage (CVT cells filled)", xlabel="step", ylabel="fraction of cells",
           ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    _legend(ax, len(present))
    return _save(fig, Path(out_path))


def plot_ratings(metrics: str | os.PathLike | Rows, out_path: str | os.PathLike) -> Path | None:
    """TrueSkill mu per member with a +-sigma band; teachers and students in separate panels."""
    rows = _rows(metrics)
    keys = _matching(rows, _RATING_MU)
    if not keys:
        _skip("ratings", f"'{PREFIX}/rating/<id>/mu' keys")
        return None
    # Role from the id prefix (t = teacher, s = student, anything else, e.g. the single agent a0, on its own).
    groups: dict[str, list[str]] = {}
    for member_id in sorted((g[0] for g in keys.values()), key=member_sort_key):
        role = {"t": "teachers", "s": "students"}.get(member_id[:1], "members")
        groups.setdefault(role, []).append(member_id)
    order = [r for r in ("teachers", "students", "members") if r in groups]
    fig, axes = _new_figure(1, len(order), width=6.0)
    for ax, role in zip(axes, order):
        members = groups[role]
        for member_id in members:
            steps, mu = series(rows, f"{PREFIX}/rating/{member_id}/mu")
            (line,) = ax.plot(steps, mu, linewidth=1.5, label=member_id)
            s_steps, sigma = series(rows, f"{PREFIX}/rating/{member_id}/sigma")
            if s_steps == steps:
                ax.fill_between(steps, [m - s for m, s in zip(mu, sigma)], [m + s for m, s in zip(mu, sigma)],
                                color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set(title=f"TrueSkill rating ({role}): mu \u00b1 sigma", xlabel="step", ylabel="mu")
        ax.grid(alpha=0.3)
        _legend(ax, len(members))
    return _save(fig, Path(out_path))


PLOTS: dict[str, Callable[[Any, Any], Path | None]] = {
    "solve_rates": plot_solve_rates,
    "validity": plot_validity,
    "complexity": plot_complexity,
    "coverage": plot_coverage,
    "ratings": plot_ratings,
}


def plot_all(metrics: str | os.PathLike | Rows, out_dir: str | os.PathLike) -> list[Path]:
    """Every plot the log (a path, or rows already read) has data for, as ``<out_dir>/<name>.png``; returns the
    files written."""
    rows = _rows(metrics)
    out_dir = Path(out_dir)
    written = []
    for name, plot in PLOTS.items():
        path = plot(rows, out_dir / f"{name}.png")
        if path is not None:
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a PopuLoRA run's metrics log.")
    parser.add_argument("run", help="run directory (with metrics.jsonl) or a metrics .jsonl file")
    parser.add_argument("--out", help="output folder (default: <run_dir>/plots)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run = Path(args.run)
    out = Path(args.out) if args.out else (run if run.is_dir() else run.parent) / "plots"
    for path in plot_all(run, out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
