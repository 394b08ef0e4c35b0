"""One object for the per-step problem diagnostics: complexity of valid tasks and CVT coverage, with checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from populora_verl.config import DiagnosticsConfig
from populora_verl.diagnostics.complexity import ProgramComplexity, complexities
from populora_verl.diagnostics.coverage import CoverageArchive
from populora_verl.diagnostics.metrics import complexity_metrics, coverage_metrics, merge_metrics

__all__ = ["ProblemDiagnostics"]

COVERAGE_FILE = "coverage.npz"


class ProblemDiagnostics:
    """Feed it each step's valid task programs; it returns the step's complexity and coverage metrics.

    ``save(ckpt_dir)`` / ``load(ckpt_dir, cfg)`` write and read ``<ckpt_dir>/coverage.npz`` (the run directory
    layout of docs/CONTRACTS.md), so a resumed run's coverage continues exactly.
    """

    def __init__(
        self,
        cfg: DiagnosticsConfig | None = None,
        *,
        seed: int = 0,
        archive: CoverageArchive | None = None,
        max_program_chars: int | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else DiagnosticsConfig()
        self.archive = archive if archive is not None else CoverageArchive(self.cfg, seed=seed)
        self.max_program_chars = max_program_chars

    def observe(self, programs: Sequence[str], step: int) -> dict[str, float]:
        """Measure the step's valid programs (unparsable ones are counted, not raised), add them to the archive."""
        measured, skipped = complexities(programs, max_chars=self.max_program_chars)
        return self.observe_complexities(measured, step, skipped=skipped)

    def observe_complexities(
        self, measured: Sequence[ProgramComplexity], step: int, *, skipped: int = 0
    ) -> dict[str, float]:
        new_cells = self.archive.add(measured, step)
        return merge_metrics(
            complexity_metrics(measured, self.cfg.descriptors, skipped=skipped),
            coverage_metrics(self.archive, new_cells=new_cells),
        )

    def save(self, ckpt_dir: str | os.PathLike) -> Path:
        return self.archive.save(Path(ckpt_dir) / COVERAGE_FILE)

    @classmethod
    def load(
        cls, ckpt_dir: str | os.PathLike, cfg: DiagnosticsConfig | None = None, *, max_program_chars: int | None = None
    ) -> ProblemDiagnostics:
        cfg = cfg if cfg is not None else DiagnosticsConfig()
        archive = CoverageArchive.load(Path(ckpt_dir) / COVERAGE_FILE, cfg)
        return cls(cfg, archive=archive, max_program_chars=max_program_chars)
