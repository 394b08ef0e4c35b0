"""Population report: the member x benchmark table with population statistics, and the run report.

Averages (documented in docs/evaluation.md): **code** = mean of HumanEval+, MBPP+ and LiveCodeBench (those
evaluated); **math** = mean of AIME24, AIME25, AMC23, MATH-500, Minerva, OlympiadBench and GSM8K (those evaluated;
the PopuLoRA paper lists GSM8K with math, AZR's math average has the other six); **avg** = (code + math) / 2 as in
AZR's "total". Population mean / min / max are taken column by column over the population members (every row
that is not ``base`` or ``baseline``), so "min" of an average column is the weakest member on that aggregate.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

from populora_verl.diagnostics.lineage import (
    find_population_dir,
    member_sort_key,
    plot_lineage,
    read_lineage,
    read_population,
)
from populora_verl.eval.data import BENCHMARKS, CODE_BENCHMARKS, MATH_BENCHMARKS

__all__ = [
    "population_table",
    "write_table",
    "markdown_table",
    "find_population_dir",
    "read_lineage",
    "plot_lineage",
    "final_ratings",
    "build_run_report",
    "build_compare_report",
    "wilson_interval",
    "table_intervals",
    "markdown_interval_table",
    "paired_differences",
    "markdown_difference_table",
    "young_members",
]

AGG_COLUMNS = ("code_avg", "math_avg", "avg")
NON_POPULATION_ROLES = ("base", "baseline")


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _row_aggregates(scores: dict[str, float | None]) -> dict[str, float | None]:
    code = _mean([scores.get(b) for b in CODE_BENCHMARKS])
    mth = _mean([scores.get(b) for b in MATH_BENCHMARKS])
    both = _mean([code, mth]) if code is not None and mth is not None else (code if mth is None else mth)
    return {"code_avg": code, "math_avg": mth, "avg": both}


def population_table(results: dict[str, Any]) -> dict[str, Any]:
    """Rows (``name``, ``role``, ``kind``: member | base | baseline | stat, one value per column, fractions in
    [0, 1] or None) and ``columns`` (benchmarks in evaluation order, then the averages)."""
    benches = [b for b in results["benchmarks"]]
    columns = benches + list(AGG_COLUMNS)
    rows: list[dict[str, Any]] = []
    for m in results["members"]:
        sc = results["scores"].get(m["name"], {})
        vals = {b: (sc[b]["pass@1"] if b in sc else None) for b in benches}
        vals.update(_row_aggregates(vals))
        kind = m["role"] if m["role"] in NON_POPULATION_ROLES else "member"
        rows.append({"name": m["name"], "role": m["role"], "kind": kind, **vals})
    pop = [r for r in rows if r["kind"] == "member"]
    stats = []
    if pop:
        groups = [("population", pop)]
        roles = sorted({r["role"] for r in pop})
        if len(roles) > 1:
            groups += [(f"{role}s", [r for r in pop if r["role"] == role]) for role in roles]
        for label, group in groups:
            for stat, fn in (("mean", _mean), ("min", min), ("max", max)):
                if label != "population" and stat != "mean":
                    continue
                row = {"name": f"{label} {stat}", "role": "", "kind": "stat"}
                for c in columns:
                    vals = [r[c] for r in group if r[c] is not None]
                    row[c] = fn(vals) if vals else None
                stats.append(row)
    order = {"base": 0, "baseline": 1, "member": 2}
    rows.sort(key=lambda r: order[r["kind"]])
    return {"columns": columns, "rows": rows + stats}


def _display(col: str) -> str:
    return (
        BENCHMARKS[col].display
        if col in BENCHMARKS
        else {"code_avg": "Code avg", "math_avg": "Math avg", "avg": "Avg"}.get(col, col)
    )


def markdown_table(table: dict[str, Any], *, percent: bool = True) -> str:
    """Markdown: pass@1 in percent (one decimal), '-' where not evaluated; stat rows in bold."""
    cols = table["columns"]
    head = "| model | role | " + " | ".join(_display(c) for c in cols) + " |"
    sep = "|---|---|" + "---:|" * len(cols)
    lines = [head, sep]
    for r in table["rows"]:
        cells = []
        for c in cols:
            v = r[c]
            cells.append("-" if v is None else (f"{100 * v:.1f}" if percent else f"{v:.4f}"))
        name = f"**{r['name']}**" if r["kind"] == "stat" else r["name"]
        lines.append(f"| {name} | {r['role']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_table(results: dict[str, Any], out_dir: str | Path, stem: str = "eval") -> dict[str, Path]:
    """Write ``<stem>.md``, ``<stem>.csv`` (fractions) and ``<stem>.json`` (the table + the raw results)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = population_table(results)
    md = out / f"{stem}.md"
    diffs = paired_differences(results, table)
    md.write_text(
        f"# Evaluation (greedy pass@1, %)\n\n{markdown_table(table)}\n\n{_notes(results)}\n\n"
        + _uncertainty_sections(results, table, diffs, level=2),
        encoding="utf-8",
    )
    cs = out / f"{stem}.csv"
    with open(cs, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["model", "role", "kind"] + table["columns"])
        for r in table["rows"]:
            w.writerow(
                [r["name"], r["role"], r["kind"]] + ["" if r[c] is None else f"{r[c]:.6f}" for c in table["columns"]]
            )
    js = out / f"{stem}.json"
    intervals = {
        name: {c: list(iv) for c, iv in cells.items()} for name, cells in table_intervals(results, table).items()
    }
    js.write_text(
        json.dumps({"table": table, "intervals": intervals, "differences": diffs, "results": results}, indent=1),
        encoding="utf-8",
    )
    return {"md": md, "csv": cs, "json": js}


def _notes(results: dict[str, Any]) -> str:
    bits = [
        "Code avg = mean of HumanEval+ / MBPP+ / LCB present; Math avg = mean of AIME24, AIME25, AMC23, MATH500, "
        "Minerva, OlympiadBench, GSM8K present; Avg = (Code + Math) / 2. HumanEval+/MBPP+ use base + plus tests."
    ]
    if results.get("limit"):
        bits.append(f"Smoke run: first {results['limit']} items per benchmark only.")
    n = {b: max((s[b]["n"] for s in results["scores"].values() if b in s), default=0) for b in results["benchmarks"]}
    bits.append("Items: " + ", ".join(f"{_display(b)} {k}" for b, k in n.items()) + ".")
    young = results.get("young_members") or {}
    if young:
        bits.append(
            f"Younger than the final quiet window ({results.get('age_window')} steps), so possibly not "
            "recovered from their operator: " + ", ".join(f"{m} ({a} steps)" for m, a in young.items()) + "."
        )
    return " ".join(bits)


# --- 95% intervals --------------------------------------------------------------------------------------------

CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 2000


def wilson_interval(correct: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (``correct`` of ``n`` items)."""
    from scipy.stats import binomtest

    ci = binomtest(int(correct), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def _column_draws(
    results: dict[str, Any], members: Sequence[str], columns: Sequence[str], samples: int, seed: int
) -> dict[str, Any] | None:
    """Bootstrap draws (members x samples) of every column: items resampled with replacement, per benchmark, the
    same draw for every member (paired). None when a member lacks per-item outcomes (older results files)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    draws: dict[str, Any] = {}
    for b in results["benchmarks"]:
        rows = []
        for m in members:
            sc = results["scores"].get(m, {}).get(b)
            if sc is None:
                rows.append(None)
                continue
            if "outcomes" not in sc:
                return None
            rows.append(np.asarray(sc["outcomes"], dtype=float))
        present = [r for r in rows if r is not None]
        if not present or len({len(r) for r in present}) != 1:
            continue
        idx = rng.integers(0, len(present[0]), size=(samples, len(present[0])))
        draws[b] = np.stack([r[idx].mean(axis=1) if r is not None else np.full(samples, np.nan) for r in rows])
    for agg, benches in (("code_avg", CODE_BENCHMARKS), ("math_avg", MATH_BENCHMARKS)):
        parts = [draws[b] for b in benches if b in draws]
        if parts:
            draws[agg] = np.nanmean(np.stack(parts), axis=0) if len(parts) > 1 else parts[0]
    if "code_avg" in draws and "math_avg" in draws:
        draws["avg"] = (draws["code_avg"] + draws["math_avg"]) / 2
    elif "code_avg" in draws or "math_avg" in draws:
        draws["avg"] = draws.get("code_avg", draws.get("math_avg"))
    return {c: draws[c] for c in columns if c in draws}


def _percentile_interval(x: Any) -> tuple[float, float] | None:
    """Central 95% percentile interval of bootstrap draws, draws without a value (NaN) left out."""
    import numpy as np

    x = x[~np.isnan(x)]
    lo_q, hi_q = 100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2
    return (float(np.percentile(x, lo_q)), float(np.percentile(x, hi_q))) if x.size else None


def _group_draws(column_draws: Any, rows: Sequence[int], stat: str) -> Any | None:
    """Draws of ``stat`` (mean | min | max) over the members ``rows`` of one column's draws, taken draw by draw so
    the best member is re-chosen on every resample; None when a draw has none of them evaluated."""
    import numpy as np

    sub = column_draws[list(rows)]
    if np.isnan(sub).all(axis=0).any():
        return None
    return {"mean": np.nanmean, "min": np.nanmin, "max": np.nanmax}[stat](sub, axis=0)


def _group_members(table: dict[str, Any], label: str) -> list[str]:
    """Members behind a stat row label: ``population`` (every member row) or ``<role>s``."""
    return [
        r["name"]
        for r in table["rows"]
        if r["kind"] == "member" and (label == "population" or f"{r['role']}s" == label)
    ]


def table_intervals(
    results: dict[str, Any], table: dict[str, Any] | None = None, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, dict[str, tuple[float, float]]]:
    """95% interval of every number of :func:`population_table`: ``{row name: {column: (low, high)}}``.

    A member's pass@1 on one benchmark: Wilson score interval. Averages over benchmarks and the population rows
    (mean, min, max over members): percentile bootstrap over items, resampled per benchmark and paired across
    members; the best member is re-chosen in every draw, so its interval includes the selection. Rows without
    per-item outcomes get Wilson intervals only.
    """
    import numpy as np

    table = table or population_table(results)
    columns = table["columns"]
    names = [r["name"] for r in table["rows"] if r["kind"] != "stat"]
    draws = _column_draws(results, names, columns, samples, seed)
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for row in table["rows"]:
        cells: dict[str, tuple[float, float]] = {}
        if row["kind"] != "stat":
            i = names.index(row["name"])
            for c in columns:
                sc = results["scores"].get(row["name"], {}).get(c)
                if sc is not None and sc.get("n"):
                    cells[c] = wilson_interval(sc["correct"], sc["n"])
                elif draws is not None and c in draws and not np.isnan(draws[c][i]).all():
                    ci = _percentile_interval(draws[c][i])
                    if ci is not None:
                        cells[c] = ci
        elif draws is not None:
            label, stat = row["name"].rsplit(" ", 1)
            rows_idx = [names.index(n) for n in _group_members(table, label)]
            for c in columns:
                if stat not in ("mean", "min", "max") or c not in draws:
                    continue
                side = _group_draws(draws[c], rows_idx, stat)
                ci = _percentile_interval(side) if side is not None else None
                if ci is not None:
                    cells[c] = ci
        out[row["name"]] = cells
    return out


def markdown_interval_table(results: dict[str, Any], table: dict[str, Any] | None = None) -> str:
    """The population table with each number as ``pass@1 [low, high]`` in percent (95% intervals)."""
    table = table or population_table(results)
    ci = table_intervals(results, table)
    cols = table["columns"]
    lines = ["| model | role | " + " | ".join(_display(c) for c in cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for r in table["rows"]:
        cells = []
        for c in cols:
            v, iv = r[c], ci.get(r["name"], {}).get(c)
            if v is None:
                cells.append("-")
            else:
                cells.append(f"{100 * v:.1f} [{100 * iv[0]:.1f}, {100 * iv[1]:.1f}]" if iv else f"{100 * v:.1f}")
        name = f"**{r['name']}**" if r["kind"] == "stat" else r["name"]
        lines.append(f"| {name} | {r['role']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


INTERVAL_NOTE = (
    "95% intervals: Wilson score interval for a member on one benchmark; percentile bootstrap over "
    f"items ({BOOTSTRAP_SAMPLES} draws, resampled per benchmark, paired across members) for averages "
    "and population rows, the best member re-chosen in every draw."
)


# --- paired differences ---------------------------------------------------------------------------------------


_Side = tuple[str, str, list[str], str]  # (label, table row, members, stat over the members)


def _comparison_sides(table: dict[str, Any]) -> list[tuple[_Side, _Side]]:
    """The pairs users read off the table, ``(a side, b side)`` for a - b: population mean and max against each
    baseline, population mean against each base, each baseline against each base; pairs with a missing side are
    left out."""
    pop = _group_members(table, "population")
    base = [r["name"] for r in table["rows"] if r["kind"] == "base"]
    baseline = [r["name"] for r in table["rows"] if r["kind"] == "baseline"]

    def member(name: str, role: str) -> _Side:
        return (name if name == role else f"{name} ({role})", name, [name], "mean")

    mean = ("population mean", "population mean", pop, "mean")
    best = ("population max", "population max", pop, "max")
    pairs = []
    for bl in baseline:
        pairs += [(side, member(bl, "baseline")) for side in (mean, best) if pop]
    for b in base:
        pairs += [(mean, member(b, "base"))] if pop else []
        pairs += [(member(bl, "baseline"), member(b, "base")) for bl in baseline]
    return pairs


def paired_differences(
    results: dict[str, Any], table: dict[str, Any] | None = None, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> list[dict[str, Any]]:
    """Differences (fractions) between the population and the baseline / base model, with 95% paired bootstrap
    intervals: ``[{"name", "a", "b", "diff": {column: a - b}, "interval": {column: [low, high]}}]``.

    Pairs: population mean - baseline, population max - baseline, population mean - base, baseline - base (those
    whose rows exist). Per-member intervals overlap even when one side wins on nearly every item; resampling the
    same items for both sides cancels the item difficulty they share, so the difference's interval is far tighter.
    The draws are those of :func:`table_intervals` (same seed, same items) and the best member is re-chosen in
    every draw. Columns where either side is missing get no entry; results without per-item outcomes get the
    point differences only.
    """
    table = table or population_table(results)
    columns = table["columns"]
    rows = {r["name"]: r for r in table["rows"]}
    names = [r["name"] for r in table["rows"] if r["kind"] != "stat"]
    draws = _column_draws(results, names, columns, samples, seed)
    out = []
    for (a_label, a_row, a_members, a_stat), (b_label, b_row, b_members, b_stat) in _comparison_sides(table):
        diff: dict[str, float] = {}
        interval: dict[str, list[float]] = {}
        for c in columns:
            if rows[a_row][c] is None or rows[b_row][c] is None:
                continue
            diff[c] = rows[a_row][c] - rows[b_row][c]
            if draws is None or c not in draws:
                continue
            a = _group_draws(draws[c], [names.index(n) for n in a_members], a_stat)
            b = _group_draws(draws[c], [names.index(n) for n in b_members], b_stat)
            ci = _percentile_interval(a - b) if a is not None and b is not None else None
            if ci is not None:
                interval[c] = list(ci)
        out.append({"name": f"{a_label} - {b_label}", "a": a_row, "b": b_row, "diff": diff, "interval": interval})
    return out


def markdown_difference_table(
    results: dict[str, Any], table: dict[str, Any] | None = None, diffs: list[dict[str, Any]] | None = None
) -> str:
    """One row per pair of :func:`paired_differences`: ``+diff [low, high]`` in percentage points."""
    table = table or population_table(results)
    diffs = paired_differences(results, table) if diffs is None else diffs
    if not diffs:
        return "No pair to compare: needs population members with a baseline or base row, or both of those."
    cols = table["columns"]
    lines = ["| difference | " + " | ".join(_display(c) for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for d in diffs:
        cells = []
        for c in cols:
            v, iv = d["diff"].get(c), d["interval"].get(c)
            if v is None:
                cells.append("-")
            else:
                cells.append(f"{100 * v:+.1f} [{100 * iv[0]:+.1f}, {100 * iv[1]:+.1f}]" if iv else f"{100 * v:+.1f}")
        lines.append(f"| {d['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DIFFERENCE_NOTE = (
    f"Paired differences: the same resampled items for both sides ({BOOTSTRAP_SAMPLES} draws, per "
    "benchmark, the population max re-chosen in every draw), 95% percentile interval; an interval "
    "that excludes 0 is a difference the item sample supports, even where the intervals above overlap."
)


def _uncertainty_sections(
    results: dict[str, Any],
    table: dict[str, Any] | None = None,
    diffs: list[dict[str, Any]] | None = None,
    *,
    level: int = 2,
) -> str:
    """The intervals table and the paired differences with their notes, headings at markdown ``level``."""
    table = table or population_table(results)
    h = "#" * level
    return (
        f"{h} With 95% intervals\n\n{markdown_interval_table(results, table)}\n\n{INTERVAL_NOTE}\n\n"
        f"{h} Paired differences (percentage points, 95% paired bootstrap)\n\n"
        f"{markdown_difference_table(results, table, diffs)}\n\n{DIFFERENCE_NOTE}\n"
    )


def young_members(state: dict[str, Any]) -> tuple[dict[str, int], int | None]:
    """``({member id: age in steps}, window)``: alive members of a ``population.json`` younger than its
    ``age_window`` (``pbt.final_quiet_steps``). A save without ages counts steps since birth."""
    window = state.get("age_window")
    if window is None:
        return {}, None
    step = int(state.get("step") or 0)
    out = {}
    for r in state.get("lineage", []):
        if r.get("death_step") is not None:
            continue
        age = int(r["age"]) if r.get("age") is not None else step - int(r.get("birth_step") or 0)
        if age < int(window):
            out[r["id"]] = age
    return out, int(window)


# --- run directory ----------------------------------------------------------------------------------------------


def final_ratings(metrics_rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Last logged ``populora/rating/<id>/{mu,sigma,conservative}`` per member."""
    out: dict[str, dict[str, float]] = {}
    pat = re.compile(r"populora/rating/([^/]+)/(mu|sigma|conservative)$")
    for row in metrics_rows:
        for k, v in row.items():
            m = pat.match(k)
            if m and isinstance(v, (int, float)):
                out.setdefault(m.group(1), {})[m.group(2)] = float(v)
    return out


def build_run_report(
    run_dir: str | Path, out_dir: str | Path | None = None, *, eval_results: dict[str, Any] | None = None
) -> Path:
    """Write ``<out_dir>/report.md`` (default ``<run_dir>/report``): evaluation table (if any), dynamics plots
    from ``metrics.jsonl`` (``populora_verl.diagnostics.plot_all``), final ratings, lineage tree and records."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# PopuLoRA run report\n\nRun directory: `{run}`\n"]

    if eval_results is None and (run / "eval" / "results.json").is_file():
        eval_results = json.loads((run / "eval" / "results.json").read_text(encoding="utf-8"))
    if eval_results is not None:
        paths = write_table(eval_results, out)
        parts.append(
            "## Evaluation (greedy pass@1, %)\n\n"
            + markdown_table(population_table(eval_results))
            + f"\n\n{_notes(eval_results)} Files: `{paths['csv'].name}`, `{paths['json'].name}`.\n\n"
            + _uncertainty_sections(eval_results, level=3)
        )
    else:
        parts.append("## Evaluation\n\nNo evaluation results (run `populora-eval --run-dir ...` first).\n")

    metrics = run / "metrics.jsonl"
    last_step = None
    if metrics.is_file():
        from populora_verl.diagnostics.plots import events_from_metrics, plot_all, read_events, read_metrics

        rows = read_metrics(metrics)
        last_step = max((int(r["step"]) for r in rows if "step" in r), default=None)
        plots = plot_all(rows, out / "plots", events=read_events(run) or events_from_metrics(rows))
        parts.append(f"## Training dynamics\n\n{len(rows)} logged steps (last: {last_step}).\n")
        for p in plots:
            parts.append(f"### {p.stem.replace('_', ' ')}\n\n![{p.stem}](plots/{p.name})\n")
    else:
        parts.append("## Training dynamics\n\nNo metrics.jsonl in the run directory.\n")

    # Final ratings: the checkpoint's own (alive members, newborns of the last evolution included), then the last
    # logged values of members that died, marked as such.
    ratings = final_ratings(rows) if metrics.is_file() else {}
    pop_dir = find_population_dir(run)
    died: dict[str, int] = {}
    if pop_dir is not None:
        pop_json = json.loads((pop_dir / "population.json").read_text(encoding="utf-8"))
        for mid, (mu, sigma) in (pop_json.get("ratings", {}).get("ratings") or {}).items():
            ratings[mid] = {"mu": float(mu), "sigma": float(sigma), "conservative": float(mu) - 3 * float(sigma)}
        died = {r["id"]: r["death_step"] for r in pop_json.get("lineage", []) if r.get("death_step") is not None}
    if ratings:
        lines = ["| member | mu | sigma | mu - 3 sigma | status |", "|---|---:|---:|---:|---|"]
        for mid in sorted(ratings, key=member_sort_key):
            r = ratings[mid]
            cons = r.get("conservative", r.get("mu", math.nan) - 3 * r.get("sigma", math.nan))
            status = f"replaced at step {died[mid]} (last logged rating)" if mid in died else "alive"
            lines.append(
                f"| {mid} | {r.get('mu', math.nan):.2f} | {r.get('sigma', math.nan):.2f} | {cons:.2f} | {status} |"
            )
        parts.append("### Final TrueSkill ratings\n\n" + "\n".join(lines) + "\n")

    if pop_dir is not None:
        lineage = read_lineage(pop_dir)
        if lineage:
            young, window = young_members(read_population(pop_dir))
            img = plot_lineage(lineage, out / "lineage.png", last_step=last_step)
            lines = [
                "| id | role | parents | operator | born | died | age (steps) |",
                "|---|---|---|---|---:|---:|---:|",
            ]
            for r in lineage:
                age = "-" if r.get("age") is None else str(r["age"])
                lines.append(
                    f"| {r['id']} | {r.get('role', '')} | {', '.join(r.get('parents') or []) or '-'} | "
                    f"{r.get('operator') or '-'} | {r.get('birth_step', 0)} | "
                    f"{'-' if r.get('death_step') is None else r['death_step']} | "
                    f"{age}{' (young)' if r['id'] in young else ''} |"
                )
            note = ""
            if young:
                note = (
                    f"\n\nYoung members (alive, trained fewer than the final quiet window of {window} steps, "
                    f"so possibly not recovered from their operator): {', '.join(young)}."
                )
            parts.append(
                f"## Lineage\n\nFrom `{pop_dir / 'population.json'}`.\n\n![lineage]({img.name})\n\n"
                + "\n".join(lines)
                + note
                + "\n"
            )
    else:
        parts.append("## Lineage\n\nNo population.json found in the run directory.\n")
    report = out / "report.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    return report


def build_compare_report(
    run_dirs: Sequence[str | Path], out_dir: str | Path, *, labels: Sequence[str] | None = None
) -> Path:
    """``<out_dir>/compare.md`` with one figure per quantity, every run on the same axes
    (:func:`populora_verl.diagnostics.plots.compare_runs`), and each run's last logged headline numbers."""
    from populora_verl.diagnostics.plots import compare_runs, read_metrics

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = compare_runs(run_dirs, out, labels=labels)
    names = list(labels) if labels else [Path(r).name for r in run_dirs]
    keys = [
        ("steps", None),
        ("solve rate", "populora/student/accuracy"),
        ("validity", "populora/validity/mean"),
        ("coverage", "populora/coverage/fraction"),
    ]
    lines = ["| run | " + " | ".join(k for k, _ in keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, run in zip(names, run_dirs):
        rows = read_metrics(run)
        cells = [str(max((int(r["step"]) for r in rows), default=0))]
        for _, key in keys[1:]:
            vals = [r[key] for r in rows if key in r]
            cells.append(f"{vals[-1]:.3f}" if vals else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    parts = [
        "# PopuLoRA runs compared\n",
        "Runs: " + ", ".join(f"`{r}`" for r in run_dirs) + "\n",
        "## Last logged step\n\n" + "\n".join(lines) + "\n",
        "## Figures\n",
    ]
    parts += [f"### {p.stem.replace('_', ' ')}\n\n![{p.stem}]({p.name})\n" for p in figures]
    report = out / "compare.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    return report
