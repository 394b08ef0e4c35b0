"""PNG plots of a run's metrics log (``<run_dir>/metrics.jsonl``), and of several runs side by side.

``python -m populora_verl.diagnostics.plots <run_dir> [--out <dir>]`` writes every plot the log has data for into
``<run_dir>/plots`` (default). A plot whose keys are absent from the log is skipped with a logged note.
:func:`compare_runs` (``populora-report --compare RUN RUN ...``) draws one figure per quantity with every run on
the same axes.

Every figure has integer step ticks, a marker on every point (a member rated at one step only is still a dot), and
the run's evolution events as dotted vertical lines half a step after the step that ended with them, labelled
with each child and its operator. Events come from ``evolution.jsonl`` (CPU driver) or the lineage of the latest
``population.json`` (both engines), else from the ``populora/evolution/events`` counts.

matplotlib is imported lazily and used through its object API with the Agg canvas, so plotting neither needs a
display nor changes the process-wide pyplot backend of the caller.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from populora_verl.diagnostics.lineage import member_sort_key
from populora_verl.diagnostics.metrics import PREFIX, read_metrics

__all__ = [
    "series",
    "EvolutionEvent",
    "read_events",
    "events_from_metrics",
    "plot_solve_rates",
    "plot_validity",
    "plot_validity_by_type",
    "plot_complexity",
    "plot_coverage",
    "plot_ratings",
    "plot_response_length",
    "plot_reward",
    "plot_all",
    "compare_runs",
    "PLOTS",
]

logger = logging.getLogger(__name__)

Rows = Sequence[Mapping[str, float]]

_PAIR = re.compile(rf"^{PREFIX}/pair/([^/]+)/([^/]+)/solve_rate$")
_VALIDITY = re.compile(rf"^{PREFIX}/validity/([^/]+)$")
_TYPE_VALIDITY = re.compile(rf"^{PREFIX}/task_type/([^/]+)/validity$")
_COMPLEXITY = re.compile(rf"^{PREFIX}/complexity/([^/]+)/mean$")
_RATING_MU = re.compile(rf"^{PREFIX}/rating/([^/]+)/mu$")
_ROLE_LENGTH = re.compile(rf"^{PREFIX}/role/([^/]+)/response_length_mean$")
_ROLE_REWARD = re.compile(rf"^{PREFIX}/role/([^/]+)/reward_mean$")
ACCURACY = f"{PREFIX}/student/accuracy"
EVENTS = f"{PREFIX}/evolution/events"
MARKER = dict(marker="o", markersize=3.5)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _marker(index: int) -> dict[str, Any]:
    """Marker of the ``index``-th line of an axes. Lines often coincide (founders before their first game, rates
    that all sit at 0): shapes and sizes that differ, and hollow ones, keep each line visible where they overlap."""
    return dict(
        marker=_MARKERS[index % len(_MARKERS)],
        markersize=max(3.0, 7.0 - index),
        markerfacecolor="none" if index % 2 else None,
    )


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


# --- evolution events ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvolutionEvent:
    """One replacement at the end of ``step``: ``child`` (made by ``operator`` from ``parents``) took a slot."""

    step: int
    child: str
    operator: str
    parents: tuple[str, ...] = ()
    victim: str | None = None

    @property
    def label(self) -> str:
        if not self.child:
            return self.operator
        return (
            f"{self.child} = {self.operator}({', '.join(self.parents)})"
            if self.parents
            else f"{self.child} = {self.operator}"
        )


def _events_from_log(path: Path) -> list[EvolutionEvent]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            plan = json.loads(line)
            for r in plan.get("replacements", []):
                out.append(
                    EvolutionEvent(
                        int(plan["step"]),
                        str(r["child_id"]),
                        str(r.get("operator") or "?"),
                        tuple(r.get("parent_ids") or ()),
                        r.get("victim_id"),
                    )
                )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a half-written or foreign line: the other events still count
    return out


def read_events(run_dir: str | os.PathLike) -> list[EvolutionEvent]:
    """The run's evolution events: ``evolution.jsonl`` if present, else the lineage of the latest population
    checkpoint (children only). Never raises on a damaged file: it logs a note and returns what it could read."""
    run = Path(run_dir)
    if run.is_file():
        run = run.parent
    try:
        if (run / "evolution.jsonl").is_file():
            return _events_from_log(run / "evolution.jsonl")
        from populora_verl.diagnostics.lineage import find_population_dir, read_lineage

        pop_dir = find_population_dir(run)
        if pop_dir is None:
            return []
        return [
            EvolutionEvent(
                int(r.get("birth_step") or 0),
                str(r["id"]),
                str(r.get("operator") or "?"),
                tuple(r.get("parents") or ()),
            )
            for r in read_lineage(pop_dir)
            if r.get("parents")
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.info("evolution events of %s not read: %s", run, e)
        return []


def events_from_metrics(rows: Rows) -> list[EvolutionEvent]:
    """Unnamed events from the ``populora/evolution/events`` counts (when no lineage is at hand)."""
    out = []
    for step, n in zip(*series(rows, EVENTS)):
        if n > 0:
            out.append(EvolutionEvent(int(step), "", f"{int(n)} replaced"))
    return out


def _mark_events(ax: Any, events: Sequence[EvolutionEvent], color: str = "dimgray", prefix: str = "") -> None:
    by_step: dict[int, list[EvolutionEvent]] = {}
    for e in events:
        by_step.setdefault(e.step, []).append(e)
    for step, evs in sorted(by_step.items()):
        x = step + 0.5  # replacements happen after the step's update: between step and step + 1
        ax.axvline(x, color=color, linestyle=":", linewidth=1.2, alpha=0.8)
        text = prefix + ", ".join(e.label for e in evs)
        ax.text(
            x,
            0.98,
            text,
            transform=ax.get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=color,
            bbox=dict(facecolor="white", alpha=0.6, edgecolor="none", pad=1.0),
        )


# --- figure helpers --------------------------------------------------------------------------------------------


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
    if n:  # outside the axes, so it never hides a line or an event label
        ax.legend(
            fontsize="small",
            ncol=max(1, math.ceil(n / 16)),
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
        )


def _style(
    ax: Any,
    *,
    title: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    legend: int = 0,
    events: Sequence[EvolutionEvent] = (),
) -> None:
    """Title, labels, integer step ticks, grid, events, legend: the same on every axes."""
    from matplotlib.ticker import MaxNLocator

    ax.set(title=title, xlabel="step", ylabel=ylabel)
    for line in ax.get_lines():  # long runs: small markers, so points stay apart (a lone point keeps its size)
        if len(line.get_xdata()) > 40:
            line.set_markersize(min(line.get_markersize(), 2.5))
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    _mark_events(ax, events)
    _legend(ax, legend)


RATE = (-0.02, 1.02)


def _group_values(rows: Rows, pattern: re.Pattern) -> list[str]:
    roles = {g[0] for g in _matching(rows, pattern).values()}
    return [r for r in ("teacher", "student") if r in roles] + sorted(roles - {"teacher", "student"})


# --- individual plots ------------------------------------------------------------------------------------------


def plot_solve_rates(
    metrics: str | os.PathLike | Rows, out_path: str | os.PathLike, *, events: Sequence[EvolutionEvent] = ()
) -> Path | None:
    """Solve rate of every (teacher, student) pair over steps, and of all students together (dashed)."""
    rows = _rows(metrics)
    keys = _matching(rows, _PAIR)
    has_acc = any(ACCURACY in r for r in rows)
    if not keys and not has_acc:
        _skip("solve_rates", f"'{PREFIX}/pair/<teacher>/<student>/solve_rate' or '{ACCURACY}' keys")
        return None
    fig, (ax,) = _new_figure()
    for j, (key, (teacher, student)) in enumerate(
        sorted(keys.items(), key=lambda kv: tuple(map(member_sort_key, kv[1])))
    ):
        ax.plot(*series(rows, key), linewidth=1, label=f"{teacher} -> {student}", **_marker(j))
    if has_acc:
        ax.plot(
            *series(rows, ACCURACY), color="black", linestyle="--", linewidth=2, label="all student answers", **MARKER
        )
    # The title says what is drawn: pair rates exist only once a teacher posed a valid task (never on the tiny model).
    title = (
        "Student solve rate per (teacher, student) pair"
        if keys
        else "Student solve rate, all answers (no valid task yet, so no per-pair rate)"
    )
    _style(ax, title=title, ylabel="solve rate", ylim=RATE, legend=len(keys) + has_acc, events=events)
    return _save(fig, Path(out_path))


def plot_validity(
    metrics: str | os.PathLike | Rows, out_path: str | os.PathLike, *, events: Sequence[EvolutionEvent] = ()
) -> Path | None:
    """Valid-proposal rate per teacher over steps (all teachers together dashed)."""
    rows = _rows(metrics)
    keys = {k: g for k, g in _matching(rows, _VALIDITY).items() if g[0] != "mean"}
    mean_key = f"{PREFIX}/validity/mean"
    has_mean = any(mean_key in r for r in rows)
    if not keys and not has_mean:
        _skip("validity", f"'{PREFIX}/validity/<teacher>' keys")
        return None
    fig, (ax,) = _new_figure()
    for j, (key, (teacher,)) in enumerate(sorted(keys.items(), key=lambda kv: member_sort_key(kv[1][0]))):
        ax.plot(*series(rows, key), linewidth=1, label=teacher, **_marker(j))
    if has_mean:
        ax.plot(*series(rows, mean_key), color="black", linestyle="--", linewidth=2, label="all teachers", **MARKER)
    _style(
        ax,
        title="Valid proposals per teacher",
        ylabel="valid / proposals",
        ylim=RATE,
        legend=len(keys) + has_mean,
        events=events,
    )
    return _save(fig, Path(out_path))


def plot_complexity(
    metrics: str | os.PathLike | Rows, out_path: str | os.PathLike, *, events: Sequence[EvolutionEvent] = ()
) -> Path | None:
    """Mean of each complexity descriptor over the step's valid tasks, one panel per descriptor."""
    rows = _rows(metrics)
    keys = _matching(rows, _COMPLEXITY)
    if not keys:
        _skip("complexity", f"'{PREFIX}/complexity/<descriptor>/mean' keys")
        return None
    fig, axes = _new_figure(1, len(keys), width=5.0)
    for ax, (key, (descriptor,)) in zip(axes, keys.items()):
        ax.plot(*series(rows, key), linewidth=1, **MARKER)
        _style(ax, title=f"{descriptor} (mean over valid tasks)", ylabel=descriptor, events=events)
    return _save(fig, Path(out_path))


def plot_coverage(
    metrics: str | os.PathLike | Rows, out_path: str | os.PathLike, *, events: Sequence[EvolutionEvent] = ()
) -> Path | None:
    """Fraction of CVT cells filled: cumulative and over the recent window."""
    rows = _rows(metrics)
    cumulative, window = f"{PREFIX}/coverage/fraction", f"{PREFIX}/coverage/window_fraction"
    present = [k for k in (cumulative, window) if any(k in r for r in rows)]
    if not present:
        _skip("coverage", f"'{cumulative}' key")
        return None
    fig, (ax,) = _new_figure()
    labels = {cumulative: "cumulative", window: "last W steps"}
    for j, key in enumerate(present):
        ax.plot(*series(rows, key), linewidth=1.5, label=labels[key], **_marker(j))
    _style(
        ax,
        title="Problem-space coverage (CVT cells filled)",
        ylabel="fraction of cells",
        ylim=RATE,
        legend=len(present),
        events=events,
    )
    return _save(fig, Path(out_path))


def _rating_groups(rows: Rows) -> dict[str, list[str]]:
    # Role from the id prefix (t = teacher, s = student, anything else, e.g. the single agent a0, on its own).
    groups: dict[str, list[str]] = {}
    for member_id in sorted((g[0] for g in _matching(rows, _RATING_MU).values()), key=member_sort_key):
        role = {"t": "teachers", "s": "students"}.get(member_id[:1], "members")
        groups.setdefault(role, []).append(member_id)
    return groups


def _tied(rows: Rows, member_ids: Sequence[str]) -> set[str]:
    """Members whose mu equals another member's at some step: founders share a rating until their first game, and
    a child inherits its parent's. Drawn on top of each other, such lines hide all but one member."""
    seen: dict[tuple[int, float], str] = {}
    tied: set[str] = set()
    for mid in member_ids:
        for step, mu in zip(*series(rows, f"{PREFIX}/rating/{mid}/mu")):
            other = seen.setdefault((int(step), round(float(mu), 6)), mid)
            if other != mid:
                tied.update((mid, other))
    return tied


def _draw_rating(
    ax: Any,
    rows: Rows,
    member_id: str,
    label: str,
    color: Any = None,
    linestyle: str = "-",
    index: int = 0,
    dodge: float = 0.0,
) -> None:
    steps, mu = series(rows, f"{PREFIX}/rating/{member_id}/mu")
    steps = [x + dodge for x in steps]  # tied members side by side (a fraction of a step), not on top of each other
    (line,) = ax.plot(steps, mu, linewidth=1.5, label=label, color=color, linestyle=linestyle, **_marker(index))
    s_steps, sigma = series(rows, f"{PREFIX}/rating/{member_id}/sigma")
    s_steps = [x + dodge for x in s_steps]
    if s_steps == steps:
        if len(steps) == 1:  # a band needs two points: a one-step member gets an error bar
            ax.errorbar(steps, mu, yerr=sigma, color=line.get_color(), capsize=3, linewidth=1)
        else:
            ax.fill_between(
                steps,
                [m - s for m, s in zip(mu, sigma)],
                [m + s for m, s in zip(mu, sigma)],
                color=line.get_color(),
                alpha=0.12,
                linewidth=0,
            )


def plot_ratings(
    metrics: str | os.PathLike | Rows, out_path: str | os.PathLike, *, events: Sequence[EvolutionEvent] = ()
) -> Path | None:
    """TrueSkill mu per member with a +-sigma band; teachers and students in separate panels."""
    rows = _rows(metrics)
    groups = _rating_groups(rows)
    if not groups:
        _skip("ratings", f"'{PREFIX}/rating/<id>/mu' keys")
        return None
    order = [r for r in ("teachers", "students", "members") if r in groups]
    fig, axes = _new_figure(1, len(order), width=6.0)
    for ax, role in zip(axes, order):
        tied = _tied(rows, groups[role])
        styles = ("-", "--", ":", "-.")
        for j, member_id in enumerate(groups[role]):
            k = sorted(tied).index(member_id) if member_id in tied else 0
            dodge = (k - (len(tied) - 1) / 2) * 0.08 if member_id in tied else 0.0
            _draw_rating(
                ax,
                rows,
                member_id,
                member_id,
                index=j,
                dodge=dodge,
                linestyle=styles[k % len(styles)] if member_id in tied else "-",
            )
        _style(
            ax,
            title=f"TrueSkill rating ({role}): mu \u00b1 sigma",
            ylabel="mu",
            legend=len(groups[role]),
            events=[e for e in events if e.child[:1] == role[:1] or role == "members" or not e.child],
        )
    return _save(fig, Path(out_path))


def _plot_groups(
    name: str, pattern: re.Pattern, key_fmt: str, title: str, ylabel: str, ylim: tuple[float, float] | None = None
) -> Callable[..., Path | None]:
    """A plot with one line per value of the key's one captured group (a role, a task type)."""

    def plot(
        metrics: str | os.PathLike | Rows, out_path: str | os.PathLike, *, events: Sequence[EvolutionEvent] = ()
    ) -> Path | None:
        rows = _rows(metrics)
        groups = _group_values(rows, pattern)
        if not groups:
            _skip(name, f"'{key_fmt.format('<group>')}' keys")
            return None
        fig, (ax,) = _new_figure()
        for j, group in enumerate(groups):
            ax.plot(*series(rows, key_fmt.format(group)), linewidth=1.5, label=group, **_marker(j))
        _style(ax, title=title, ylabel=ylabel, ylim=ylim, legend=len(groups), events=events)
        return _save(fig, Path(out_path))

    plot.__name__ = f"plot_{name}"
    plot.__doc__ = f"{title} over steps."
    return plot


plot_validity_by_type = _plot_groups(
    "validity_by_type",
    _TYPE_VALIDITY,
    f"{PREFIX}/task_type/{{}}/validity",
    "Valid proposals per task type (all teachers)",
    "valid / proposals",
    RATE,
)
plot_response_length = _plot_groups(
    "response_length",
    _ROLE_LENGTH,
    f"{PREFIX}/role/{{}}/response_length_mean",
    "Mean response length per role",
    "tokens",
)
plot_reward = _plot_groups(
    "reward", _ROLE_REWARD, f"{PREFIX}/role/{{}}/reward_mean", "Mean training reward per role", "reward"
)


PLOTS: dict[str, Callable[..., Path | None]] = {
    "solve_rates": plot_solve_rates,
    "validity": plot_validity,
    "validity_by_type": plot_validity_by_type,
    "complexity": plot_complexity,
    "coverage": plot_coverage,
    "ratings": plot_ratings,
    "response_length": plot_response_length,
    "reward": plot_reward,
}


def plot_all(
    metrics: str | os.PathLike | Rows, out_dir: str | os.PathLike, *, events: Sequence[EvolutionEvent] | None = None
) -> list[Path]:
    """Every plot the log (a path, or rows already read) has data for, as ``<out_dir>/<name>.png``; returns the
    files written. ``events``: evolution events to mark (default: read from the run directory when ``metrics``
    is a path, else from the log's event counts)."""
    rows = _rows(metrics)
    if events is None:
        events = read_events(metrics) if isinstance(metrics, (str, os.PathLike)) else []
        events = events or events_from_metrics(rows)
    out_dir = Path(out_dir)
    written = []
    for name, plot in PLOTS.items():
        path = plot(rows, out_dir / f"{name}.png", events=events)
        if path is not None:
            written.append(path)
    if isinstance(metrics, (str, os.PathLike)):
        lineage = _plot_lineage(Path(metrics), out_dir / "lineage.png", rows)
        if lineage is not None:
            written.append(lineage)
    return written


def _plot_lineage(run: Path, out_path: Path, rows: Rows) -> Path | None:
    """The lineage tree of the run's latest population checkpoint (None without one, or with no children)."""
    from populora_verl.diagnostics.lineage import find_population_dir, plot_lineage, read_lineage

    run = run.parent if run.is_file() else run
    try:
        pop_dir = find_population_dir(run)
        lineage = read_lineage(pop_dir) if pop_dir is not None else []
    except (OSError, ValueError) as e:
        logger.info("plot lineage skipped: %s", e)
        return None
    if not any(r.get("parents") for r in lineage):
        logger.info("plot lineage skipped: the run has no population checkpoint with children")
        return None
    last = max((int(r["step"]) for r in rows if "step" in r), default=None)
    return plot_lineage(lineage, out_path, last_step=last)


# --- several runs ----------------------------------------------------------------------------------------------


@dataclass
class _Run:
    label: str
    rows: list[Mapping[str, float]]
    events: list[EvolutionEvent]


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    names = [p.name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.parent.name}/{p.name}" for p in run_dirs]


def _mean_series(rows: Rows, pattern: re.Pattern) -> tuple[list[float], list[float]]:
    """Per step, the mean of every key matching ``pattern`` (e.g. all pair solve rates)."""
    steps, values = [], []
    for row in rows:
        xs = [float(v) for k, v in row.items() if pattern.match(k)]
        if xs and "step" in row:
            steps.append(float(row["step"]))
            values.append(sum(xs) / len(xs))
    return steps, values


def _compare_panels(
    runs: Sequence[_Run],
    out_path: Path,
    title: str,
    ylabel: str,
    panels: Sequence[tuple[str, Callable[[Rows], tuple[list[float], list[float]]]]],
    ylim: tuple[float, float] | None = None,
) -> Path | None:
    """One panel per ``(name, series of a run)``; every run one colour in every panel. None if no run has data."""
    drawn = [(name, fn) for name, fn in panels if any(fn(r.rows)[0] for r in runs)]
    if not drawn:
        return None
    ncols = 2 if len(drawn) == 4 else min(3, len(drawn))
    nrows = math.ceil(len(drawn) / ncols)
    fig, axes = _new_figure(nrows, ncols, width=6.0 if len(drawn) > 1 else 8.0)
    for k, (ax, (name, fn)) in enumerate(zip(axes, drawn)):
        for i, run in enumerate(runs):
            xs, ys = fn(run.rows)
            if xs:
                ax.plot(xs, ys, color=f"C{i}", linewidth=1.5, label=run.label, **_marker(i))
        # Runs keep their colour in every panel: one legend, right of the first row.
        _style(
            ax,
            title=f"{title}: {name}" if name else title,
            ylabel=ylabel,
            ylim=ylim,
            legend=len(runs) if k == ncols - 1 else 0,
        )
    for ax in axes[len(drawn) :]:
        ax.set_visible(False)
    return _save(fig, out_path)


def _key(key: str) -> Callable[[Rows], tuple[list[float], list[float]]]:
    return lambda rows: series(rows, key)


def _union(runs: Sequence[_Run], pattern: re.Pattern) -> list[str]:
    return sorted({g[0] for r in runs for g in _matching(r.rows, pattern).values()})


def _compare_ratings(runs: Sequence[_Run], out_path: Path) -> Path | None:
    order = [g for g in ("teachers", "students", "members") if any(g in _rating_groups(r.rows) for r in runs)]
    if not order:
        return None
    styles = ("-", "--", "-.", ":")
    fig, axes = _new_figure(1, len(order), width=7.0)
    for ax, role in zip(axes, order):
        n = 0
        for i, run in enumerate(runs):
            members = _rating_groups(run.rows).get(role, [])
            for j, member_id in enumerate(members):
                _draw_rating(
                    ax,
                    run.rows,
                    member_id,
                    f"{run.label}: {member_id}",
                    color=f"C{i}",
                    linestyle=styles[j % len(styles)],
                    index=j,
                )
            n += len(members)
            if not members:  # another run's panel: its events would mislead here
                continue
            evs = [e for e in run.events if e.child[:1] == role[:1] or role == "members" or not e.child]
            _mark_events(ax, evs, color=f"C{i}", prefix=f"{run.label}: " if len(runs) > 1 else "")
        _style(ax, title=f"TrueSkill rating ({role}): mu \u00b1 sigma", ylabel="mu", legend=n)
    return _save(fig, out_path)


def compare_runs(
    run_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, labels: Sequence[str] | None = None
) -> list[Path]:
    """One PNG per quantity with every run on the same axes (one colour per run); returns the files written.

    Solve rate (all student answers, else the mean pair solve rate), valid proposals (all types and per task
    type), complexity of valid programs, CVT coverage (cumulative solid, window dashed), TrueSkill mu +- sigma per
    member with each run's evolution events, response length, format-error rate and training reward per role.
    """
    paths = [Path(p) for p in run_dirs]
    for p in paths:
        if not (p / "metrics.jsonl").is_file() and not (p.is_file() and p.suffix == ".jsonl"):
            raise FileNotFoundError(f"{p}: no metrics.jsonl")
    labels = list(labels) if labels else _labels([p.parent if p.is_file() else p for p in paths])
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} runs")
    runs = []
    for p, label in zip(paths, labels):
        rows = read_metrics(p)
        runs.append(_Run(label, rows, read_events(p) or events_from_metrics(rows)))
    out = Path(out_dir)

    def solve(rows: Rows) -> tuple[list[float], list[float]]:
        xs = series(rows, ACCURACY)
        return xs if xs[0] else _mean_series(rows, _PAIR)

    types = _union(runs, _TYPE_VALIDITY)
    roles = [r for r in ("teacher", "student") if r in _union(runs, _ROLE_REWARD) + _union(runs, _ROLE_LENGTH)]
    descriptors = [d for d in ("ast_depth", "cyclomatic", "loc") if d in _union(runs, _COMPLEXITY)]
    descriptors += [d for d in _union(runs, _COMPLEXITY) if d not in descriptors]
    figures: dict[str, Callable[[], Path | None]] = {
        "solve_rate": lambda: _compare_panels(
            runs, out / "solve_rate.png", "Student solve rate", "solve rate", [("", solve)], RATE
        ),
        "validity": lambda: _compare_panels(
            runs,
            out / "validity.png",
            "Valid proposals",
            "valid / proposals",
            [("all types", _key(f"{PREFIX}/validity/mean"))]
            + [(t, _key(f"{PREFIX}/task_type/{t}/validity")) for t in types],
            RATE,
        ),
        "complexity": lambda: _compare_panels(
            runs,
            out / "complexity.png",
            "Valid programs",
            "mean over the step's valid programs",
            [(d, _key(f"{PREFIX}/complexity/{d}/mean")) for d in descriptors],
        ),
        "coverage": lambda: _compare_panels(
            runs,
            out / "coverage.png",
            "CVT coverage",
            "fraction of cells",
            [
                ("cumulative", _key(f"{PREFIX}/coverage/fraction")),
                ("last W steps", _key(f"{PREFIX}/coverage/window_fraction")),
            ],
            RATE,
        ),
        "ratings": lambda: _compare_ratings(runs, out / "ratings.png"),
        "response_length": lambda: _compare_panels(
            runs,
            out / "response_length.png",
            "Mean response length",
            "tokens",
            [(r, _key(f"{PREFIX}/role/{r}/response_length_mean")) for r in roles],
        ),
        "format_error": lambda: _compare_panels(
            runs,
            out / "format_error.png",
            "Format errors (answer envelope)",
            "format errors / texts",
            [(r, _key(f"{PREFIX}/role/{r}/format_error_rate")) for r in roles],
            RATE,
        ),
        "reward": lambda: _compare_panels(
            runs,
            out / "reward.png",
            "Mean training reward",
            "reward",
            [(r, _key(f"{PREFIX}/role/{r}/reward_mean")) for r in roles],
        ),
    }
    written = []
    for name, draw in figures.items():
        path = draw()
        if path is None:
            _skip(f"compare/{name}", "data in any run")
        else:
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="populora_verl.diagnostics.plots", description="Plot a PopuLoRA run's metrics log."
    )
    parser.add_argument("run", help="run directory (with metrics.jsonl) or a metrics .jsonl file")
    parser.add_argument("--out", help="output folder (default: <run_dir>/plots)")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    args = parser.parse_args(argv)
    from populora_verl.cli_errors import UsageError, check_output_dir, run_cli

    def plot() -> int:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        run = Path(args.run)
        if not run.exists():
            raise UsageError(f"run {args.run}: no such run directory or metrics file")
        out = check_output_dir(args.out or (run if run.is_dir() else run.parent) / "plots", "--out")
        for path in plot_all(run, out):
            print(path)
        return 0

    return run_cli("populora_verl.diagnostics.plots", plot, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
