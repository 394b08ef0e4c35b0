"""Per-step metric dicts (the ``populora/...`` keys of docs/CONTRACTS.md "Metrics log") and the metrics log.

Every builder returns a flat ``dict[str, float]`` with ``/``-separated keys, the shape verl's
``Tracking.log(data=..., step=...)`` consumes, so the same dict goes to verl's loggers and to our
``<run_dir>/metrics.jsonl``. Builders drop what is undefined (a teacher with no proposals has no validity, a step
with no valid task has no complexity mean) instead of writing NaN: JSON has no NaN and plots treat a missing key
as a gap.

:class:`MetricsLogger` appends one JSON object per step to ``metrics.jsonl`` and flushes it, so a killed run keeps
every finished step; :func:`read_metrics` reads it back, tolerating the half-written last line such a kill leaves.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from populora_verl.diagnostics.complexity import ProgramComplexity

__all__ = [
    "PREFIX",
    "rating_metrics",
    "pair_metrics",
    "validity_metrics",
    "complexity_metrics",
    "coverage_metrics",
    "reward_metrics",
    "evolution_metrics",
    "merge_metrics",
    "MetricsLogger",
    "read_metrics",
]

logger = logging.getLogger(__name__)

PREFIX = "populora"
METRICS_FILE = "metrics.jsonl"


def _member_id(member_id: str) -> str:
    # Ids become key segments: a "/" would shift every segment after it and break the plots' key parsing.
    if not isinstance(member_id, str) or not member_id or "/" in member_id:
        raise ValueError(f"member id must be a non-empty string without '/', got {member_id!r}")
    return member_id


def _number(value: Any, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return x


def _mu_sigma(rating: Any) -> tuple[float, float]:
    if hasattr(rating, "mu") and hasattr(rating, "sigma"):
        return float(rating.mu), float(rating.sigma)
    mu, sigma = rating
    return float(mu), float(sigma)


def rating_metrics(ratings: Any, *, k: float = 3.0) -> dict[str, float]:
    """``populora/rating/<id>/{mu,sigma,conservative}`` with conservative = mu - k sigma.

    ``ratings``: ``{id: (mu, sigma)}``, ``{id: trueskill.Rating}``, or a
    :class:`populora_verl.population.ratings.Ratings` (anything with ``ids()`` and ``[id]``).
    """
    items = {i: ratings[i] for i in ratings.ids()} if hasattr(ratings, "ids") else dict(ratings)
    out: dict[str, float] = {}
    for member_id, rating in items.items():
        mid = _member_id(member_id)
        mu, sigma = _mu_sigma(rating)
        mu, sigma = _number(mu, f"rating of {mid} (mu)"), _number(sigma, f"rating of {mid} (sigma)")
        out[f"{PREFIX}/rating/{mid}/mu"] = mu
        out[f"{PREFIX}/rating/{mid}/sigma"] = sigma
        out[f"{PREFIX}/rating/{mid}/conservative"] = mu - k * sigma
    return out


def pair_metrics(solve_rates: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """``populora/pair/<teacher>/<student>/solve_rate`` from ``{(teacher, student): mean correctness}``."""
    out: dict[str, float] = {}
    for (teacher, student), rate in solve_rates.items():
        rate = _number(rate, f"solve rate of pair ({teacher}, {student})")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"solve rate of pair ({teacher}, {student}) must be in [0, 1], got {rate}")
        out[f"{PREFIX}/pair/{_member_id(teacher)}/{_member_id(student)}/solve_rate"] = rate
    return out


def validity_metrics(counts: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """``populora/validity/<teacher>`` = valid / proposals, and ``populora/validity/mean``.

    ``counts``: ``{teacher: (valid, proposals)}``. The mean is over teachers (each teacher weighs the same, as in
    the per-teacher curves), counting only teachers that proposed something this step.
    """
    out: dict[str, float] = {}
    for teacher, (valid, total) in counts.items():
        tid = _member_id(teacher)
        if not (0 <= int(valid) <= int(total)):
            raise ValueError(f"validity counts of {tid} must satisfy 0 <= valid <= proposals, got {valid}/{total}")
        if int(total) == 0:
            continue
        out[f"{PREFIX}/validity/{tid}"] = int(valid) / int(total)
    if out:
        out[f"{PREFIX}/validity/mean"] = sum(out.values()) / len(out)
    return out


def complexity_metrics(
    complexities: Sequence[ProgramComplexity],
    descriptors: Iterable[str] = ("ast_depth", "cyclomatic", "loc"),
    *,
    skipped: int | None = None,
) -> dict[str, float]:
    """``populora/complexity/<descriptor>/mean`` over the step's valid tasks (and their count).

    ``skipped``: programs that did not parse, logged as ``populora/complexity/unparsable`` when given.
    """
    out: dict[str, float] = {f"{PREFIX}/complexity/num_programs": float(len(complexities))}
    if skipped is not None:
        out[f"{PREFIX}/complexity/unparsable"] = float(skipped)
    if complexities:
        for d in descriptors:
            out[f"{PREFIX}/complexity/{d}/mean"] = sum(c.get(d) for c in complexities) / len(complexities)
    return out


def coverage_metrics(
    archive: Any = None,
    *,
    cells_filled: int | None = None,
    num_cells: int | None = None,
    window_cells_filled: int | None = None,
    new_cells: int | None = None,
) -> dict[str, float]:
    """``populora/coverage/{cells_filled,fraction}`` (cumulative) and ``window_cells_filled``/``window_fraction``.

    Pass a :class:`~populora_verl.diagnostics.coverage.CoverageArchive`, or the counts themselves.
    """
    if archive is not None:
        cells_filled, num_cells = archive.cells_filled, archive.num_cells
        window_cells_filled = archive.window_cells_filled()
    if cells_filled is None or not num_cells:
        raise ValueError("coverage_metrics needs an archive or cells_filled and num_cells > 0")
    out = {
        f"{PREFIX}/coverage/cells_filled": float(cells_filled),
        f"{PREFIX}/coverage/fraction": cells_filled / num_cells,
    }
    if window_cells_filled is not None:
        out[f"{PREFIX}/coverage/window_cells_filled"] = float(window_cells_filled)
        out[f"{PREFIX}/coverage/window_fraction"] = window_cells_filled / num_cells
    if new_cells is not None:
        out[f"{PREFIX}/coverage/new_cells"] = float(new_cells)
    return out


def reward_metrics(rewards: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``populora/reward/<id>/mean`` over each member's rewards of the step (members without any are left out)."""
    out: dict[str, float] = {}
    for member_id, values in rewards.items():
        values = [_number(v, f"reward of {member_id}") for v in values]
        if values:
            out[f"{PREFIX}/reward/{_member_id(member_id)}/mean"] = sum(values) / len(values)
    return out


def evolution_metrics(events: int) -> dict[str, float]:
    """``populora/evolution/events``: members replaced this step."""
    if int(events) < 0:
        raise ValueError(f"evolution events must be >= 0, got {events}")
    return {f"{PREFIX}/evolution/events": float(int(events))}


def merge_metrics(*parts: Mapping[str, float]) -> dict[str, float]:
    """Union of metric dicts; a key produced twice is a bug upstream, so it raises instead of overwriting."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key in out:
                raise ValueError(f"metric {key!r} produced twice")
            out[key] = value
    return out


# --- the log ---------------------------------------------------------------------------------------------------


def _finite_items(data: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    dropped = []
    for key, value in data.items():
        if key == "step":
            raise ValueError("'step' is reserved in the metrics log; pass it as log(..., step=N)")
        try:
            x = float(value)
        except (TypeError, ValueError):
            dropped.append(key)
            continue
        if math.isfinite(x):
            out[str(key)] = x
        else:
            dropped.append(key)
    if dropped:
        logger.warning("metrics log: dropped non-numeric or non-finite values for %s", sorted(dropped)[:10])
    return out


def _drop_partial_tail(path: Path, keep_through_step: int | None) -> None:
    """Make ``path`` safe to append to: cut a half-written last line, and rows after ``keep_through_step``."""
    if not path.exists():
        return
    raw = path.read_bytes()
    complete = raw if raw.endswith(b"\n") or not raw else raw[: raw.rfind(b"\n") + 1]
    if keep_through_step is not None:
        kept = []
        for line in complete.splitlines(keepends=True):
            if not line.strip():
                continue
            row = json.loads(line)
            if int(row["step"]) <= keep_through_step:
                kept.append(line)
        complete = b"".join(kept)
    if complete != raw:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(complete)
        os.replace(tmp, path)


class MetricsLogger:
    """Appends ``{"step": N, key: value, ...}`` lines to ``<run_dir>/metrics.jsonl``; optionally TensorBoard too.

    Same call shape as verl's ``Tracking.log(data=..., step=...)``. Each line is flushed to disk as it is written.
    Opening an existing log first removes a half-written last line (from a killed run); ``resume_step=N`` also
    drops rows after step N, so steps redone after resuming from checkpoint N are not logged twice.
    TensorBoard scalars go to ``<run_dir>/tb`` (``tensorboard=True``; torch's SummaryWriter, imported lazily).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = False,
        resume_step: int | None = None,
        filename: str = METRICS_FILE,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        _drop_partial_tail(self.path, resume_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def log(self, data: Mapping[str, Any], step: int) -> dict[str, float]:
        """Write one step's metrics; returns what was written (non-finite values are dropped with a warning)."""
        if self._fh is None:
            raise RuntimeError("MetricsLogger is closed")
        step = int(step)
        values = _finite_items(data)
        self._fh.write(json.dumps({"step": step, **values}, allow_nan=False) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        return values

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of a metrics log in file order. ``path`` is the ``.jsonl`` file or the run directory.

    A last line that is not valid JSON (a run killed mid-write) is ignored; a bad line elsewhere is corruption and
    raises ``ValueError`` naming the line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows: list[dict[str, float]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not an object with a 'step'")
        except ValueError as e:
            if number == len(lines):
                logger.info("%s: ignoring a truncated last line (%d chars)", path, len(line))
                break
            raise ValueError(f"{path}:{number}: corrupt metrics line ({e})") from None
        rows.append(row)
    return rows
