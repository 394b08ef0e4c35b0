"""Diagnostics: complexity of valid problems, CVT problem-space coverage, the metrics log and its plots.

Heavy dependencies are imported where used: radon when a program is measured, pyribs when an archive is built,
matplotlib when a plot is drawn, torch only for TensorBoard logging.
"""

from populora_verl.diagnostics.complexity import (
    DESCRIPTORS,
    ProgramComplexity,
    complexities,
    program_complexity,
)
from populora_verl.diagnostics.coverage import CoverageArchive, descriptor_vector
from populora_verl.diagnostics.metrics import (
    MetricsLogger,
    complexity_metrics,
    coverage_metrics,
    evolution_metrics,
    merge_metrics,
    pair_metrics,
    rating_metrics,
    read_metrics,
    reward_metrics,
    validity_metrics,
)
from populora_verl.diagnostics.tracker import ProblemDiagnostics

# The plots module is also a script (``python -m populora_verl.diagnostics.plots``); importing it here eagerly
# would make runpy warn about executing an already-imported module, so its names resolve on first access.
_PLOT_NAMES = (
    "plot_all",
    "plot_complexity",
    "plot_coverage",
    "plot_ratings",
    "plot_solve_rates",
    "plot_validity",
    "plot_validity_by_type",
    "plot_response_length",
    "plot_reward",
    "compare_runs",
    "read_events",
)


def __getattr__(name: str):
    if name in _PLOT_NAMES:
        from populora_verl.diagnostics import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DESCRIPTORS",
    "ProgramComplexity",
    "program_complexity",
    "complexities",
    "CoverageArchive",
    "descriptor_vector",
    "ProblemDiagnostics",
    "MetricsLogger",
    "read_metrics",
    "rating_metrics",
    "pair_metrics",
    "validity_metrics",
    "complexity_metrics",
    "coverage_metrics",
    "reward_metrics",
    "evolution_metrics",
    "merge_metrics",
    "plot_all",
    "plot_solve_rates",
    "plot_validity",
    "plot_complexity",
    "plot_coverage",
    "plot_ratings",
    "plot_validity_by_type",
    "plot_response_length",
    "plot_reward",
    "compare_runs",
    "read_events",
]
