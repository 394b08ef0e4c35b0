"""Problem-space coverage: a CVT archive (pyribs) over normalised complexity descriptors of valid tasks.

Each valid task program is mapped to a descriptor vector (by default AST depth, cyclomatic complexity, LOC; see
:mod:`populora_verl.diagnostics.complexity`), each coordinate divided by its ``descriptor_max`` bound and clipped to
[0, 1]. The unit cube is tessellated into ``cvt_cells`` Voronoi cells (k-means over ``cvt_samples`` uniform points,
seeded). Coverage is the number / fraction of cells that have held at least one task:

* cumulative: every task since the start of the run (the archive itself);
* windowed: only tasks of the last ``window`` steps (``step > current - window``): a population that keeps
  exploring holds a high windowed coverage, a collapsing curriculum's windowed coverage shrinks even though its
  cumulative coverage cannot.

The archive is a plain occupancy map: every task has objective 0, so the first task to reach a cell fills it and
later ones leave it unchanged. Per-cell visit counts are kept next to it. ``state_dict`` / ``save`` / ``load``
carry the centroids, the archive's elites, the counts and the window, so a resumed run continues exactly.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from populora_verl.config import DiagnosticsConfig
from populora_verl.diagnostics.complexity import DESCRIPTORS, ProgramComplexity

__all__ = ["descriptor_vector", "CoverageArchive"]

_STATE_VERSION = 1


def _check_descriptors(descriptors: Sequence[str], descriptor_max: Mapping[str, float]) -> None:
    for d in descriptors:
        if d not in DESCRIPTORS:
            raise ValueError(f"populora.diagnostics.descriptors: unknown descriptor {d!r} (known: {list(DESCRIPTORS)})")
        if d not in descriptor_max or not descriptor_max[d] > 0:
            raise ValueError(f"populora.diagnostics.descriptor_max.{d}: needs a bound > 0")


def descriptor_vector(
    complexity: ProgramComplexity, descriptors: Sequence[str], descriptor_max: Mapping[str, float]
) -> np.ndarray:
    """``[min(value_d / max_d, 1) for d in descriptors]``: the task's point in the unit cube."""
    _check_descriptors(descriptors, descriptor_max)
    raw = np.array([complexity.get(d) / float(descriptor_max[d]) for d in descriptors], dtype=np.float64)
    return np.clip(raw, 0.0, 1.0)


def _check_compatible(
    state: Mapping[str, np.ndarray], descriptors: Sequence[str], descriptor_max: Mapping[str, float]
) -> None:
    """A saved archive is only meaningful under the descriptors and bounds it was built with."""
    saved = tuple(str(d) for d in np.asarray(state["descriptors"]).tolist())
    if saved != tuple(descriptors):
        raise ValueError(
            f"coverage state was saved with descriptors {list(saved)}, "
            f"but populora.diagnostics.descriptors is {list(descriptors)}"
        )
    saved_max = np.asarray(state["descriptor_max"], dtype=np.float64)
    ours = np.array([float(descriptor_max[d]) for d in descriptors])
    if not np.allclose(saved_max, ours):
        raise ValueError(
            f"coverage state was saved with descriptor_max {saved_max.tolist()}, "
            f"but the config has {ours.tolist()}: the cells would not mean the same"
        )


class CoverageArchive:
    """Cumulative and windowed CVT coverage of valid tasks.

    Args:
        cfg: descriptors, their bounds, ``cvt_cells`` and ``cvt_samples`` (k-means sample size).
        window: the windowed coverage counts tasks of the last ``window`` steps (default: ``cfg.coverage_window``).
        seed: seeds the k-means that places the centroids.
        centroids: precomputed ``(cvt_cells, len(descriptors))`` centroids in the unit cube; skips k-means.
    """

    def __init__(
        self,
        cfg: DiagnosticsConfig | None = None,
        *,
        window: int | None = None,
        seed: int = 0,
        centroids: np.ndarray | None = None,
    ) -> None:
        cfg = cfg if cfg is not None else DiagnosticsConfig()
        self.descriptors: tuple[str, ...] = tuple(cfg.descriptors)
        self.descriptor_max: dict[str, float] = {d: float(cfg.descriptor_max[d]) for d in self.descriptors}
        _check_descriptors(self.descriptors, self.descriptor_max)
        window = cfg.coverage_window if window is None else window
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"coverage window must be an integer >= 1, got {window!r}")
        self.window = window
        self.seed = seed
        dim = len(self.descriptors)
        if centroids is not None:
            centroids = np.asarray(centroids, dtype=np.float64)
            if centroids.ndim != 2 or centroids.shape[1] != dim or centroids.shape[0] < 2:
                raise ValueError(f"centroids must have shape (cells >= 2, {dim}), got {centroids.shape}")
            self._archive = self._make_archive(centroids)
        else:
            from ribs.archives import CVTArchive

            self._archive = CVTArchive(
                solution_dim=1,
                centroids=int(cfg.cvt_cells),
                ranges=[(0.0, 1.0)] * dim,
                samples=int(cfg.cvt_samples),
                seed=seed,
            )
        self.num_cells = int(self._archive.centroids.shape[0])
        self.counts = np.zeros(self.num_cells, dtype=np.int64)
        self.num_tasks = 0
        # (step, cell) of every task inside the window; older entries are pruned as steps advance.
        self._recent: deque[tuple[int, int]] = deque()
        self._last_step: int | None = None

    @staticmethod
    def _make_archive(centroids: np.ndarray) -> Any:
        from ribs.archives import CVTArchive

        return CVTArchive(solution_dim=1, centroids=centroids, ranges=[(0.0, 1.0)] * centroids.shape[1])

    @property
    def centroids(self) -> np.ndarray:
        return np.asarray(self._archive.centroids)

    # --- adding ------------------------------------------------------------------------------------------------

    def points(self, complexities: Iterable[ProgramComplexity]) -> np.ndarray:
        rows = [descriptor_vector(c, self.descriptors, self.descriptor_max) for c in complexities]
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(self.descriptors))

    def add(self, complexities: Sequence[ProgramComplexity], step: int) -> int:
        """Add one step's valid tasks. Returns the number of cells that were empty before (newly covered)."""
        if self._last_step is not None and step < self._last_step:
            raise ValueError(f"coverage steps must not go backwards: got step {step} after {self._last_step}")
        self._advance(step)
        pts = self.points(complexities)
        if len(pts) == 0:
            return 0
        cells = np.asarray(self._archive.index_of(pts), dtype=np.int64)
        before = int((self.counts > 0).sum())
        self._archive.add(np.zeros((len(pts), 1)), np.zeros(len(pts)), pts)
        np.add.at(self.counts, cells, 1)
        self.num_tasks += len(pts)
        self._recent.extend((step, int(c)) for c in cells)
        return int((self.counts > 0).sum()) - before

    def _advance(self, step: int) -> None:
        self._last_step = step
        oldest = step - self.window  # entries at or before this step are out of the window
        while self._recent and self._recent[0][0] <= oldest:
            self._recent.popleft()

    # --- reading -----------------------------------------------------------------------------------------------

    @property
    def cells_filled(self) -> int:
        return len(self._archive)

    @property
    def fraction(self) -> float:
        return self.cells_filled / self.num_cells

    def window_cells_filled(self, step: int | None = None) -> int:
        """Distinct cells hit by tasks of steps ``(step - window, step]`` (default: the last step added)."""
        step = self._last_step if step is None else step
        if step is None:
            return 0
        return len({cell for s, cell in self._recent if step - self.window < s <= step})

    def window_fraction(self, step: int | None = None) -> float:
        return self.window_cells_filled(step) / self.num_cells

    # --- state -------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything needed to continue exactly: arrays only, so it saves as ``.npz`` without pickling."""
        elites = np.asarray(self._archive.data("measures"), dtype=np.float64).reshape(-1, len(self.descriptors))
        recent = np.asarray(list(self._recent), dtype=np.int64).reshape(-1, 2)
        return {
            "version": np.array(_STATE_VERSION),
            "descriptors": np.array(self.descriptors),
            "descriptor_max": np.array([self.descriptor_max[d] for d in self.descriptors], dtype=np.float64),
            "centroids": self.centroids.copy(),
            "elite_measures": elites,
            "counts": self.counts.copy(),
            "num_tasks": np.array(self.num_tasks, dtype=np.int64),
            "window": np.array(self.window, dtype=np.int64),
            "seed": np.array(self.seed, dtype=np.int64),
            "recent": recent,
            "last_step": np.array(-1 if self._last_step is None else self._last_step, dtype=np.int64),
            "has_last_step": np.array(self._last_step is not None),
        }

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore from :meth:`state_dict`. The descriptors must match this archive's configuration."""
        version = int(state["version"])
        if version != _STATE_VERSION:
            raise ValueError(f"coverage state version {version} is not supported (expected {_STATE_VERSION})")
        _check_compatible(state, self.descriptors, self.descriptor_max)
        centroids = np.asarray(state["centroids"], dtype=np.float64)
        self._archive = self._make_archive(centroids)
        elites = np.asarray(state["elite_measures"], dtype=np.float64)
        if len(elites):
            self._archive.add(np.zeros((len(elites), 1)), np.zeros(len(elites)), elites)
        self.num_cells = int(centroids.shape[0])
        self.counts = np.asarray(state["counts"], dtype=np.int64).copy()
        if self.counts.shape != (self.num_cells,):
            raise ValueError(f"coverage state counts have shape {self.counts.shape}, expected ({self.num_cells},)")
        if len(self._archive) != int((self.counts > 0).sum()):
            raise ValueError("coverage state is inconsistent: archive elites do not match the occupied counts")
        self.num_tasks = int(state["num_tasks"])
        self.window = int(state["window"])
        self.seed = int(state["seed"])
        self._recent = deque((int(s), int(c)) for s, c in np.asarray(state["recent"]).reshape(-1, 2))
        self._last_step = int(state["last_step"]) if bool(state["has_last_step"]) else None

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`state_dict` to ``path`` (``.npz``) atomically (a killed run leaves the old file intact)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **self.state_dict())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, cfg: DiagnosticsConfig | None = None) -> CoverageArchive:
        """Rebuild an archive saved by :meth:`save` (no k-means: the saved centroids are reused)."""
        with np.load(Path(path), allow_pickle=False) as data:
            state = {k: data[k] for k in data.files}
        cfg = (
            cfg
            if cfg is not None
            else DiagnosticsConfig(
                descriptors=[str(d) for d in state["descriptors"].tolist()],
                descriptor_max={
                    str(d): float(m) for d, m in zip(state["descriptors"].tolist(), state["descriptor_max"].tolist())
                },
                cvt_cells=int(state["centroids"].shape[0]),
                cvt_samples=int(state["centroids"].shape[0]),
            )
        )
        _check_compatible(state, cfg.descriptors, cfg.descriptor_max)
        archive = cls(cfg, window=int(state["window"]), seed=int(state["seed"]), centroids=state["centroids"])
        archive.load_state_dict(state)
        return archive
