"""Offline evaluation: greedy pass@1 of the base model, a baseline and every population member on HumanEval+,
MBPP+, LiveCodeBench (user-supplied), GSM8K, MATH-500, AIME 2024/2025, AMC 2023, Minerva-Math and OlympiadBench,
and the population report. Console scripts: ``populora-eval``, ``populora-report`` (see ``cli``).

Candidate programs never run in this process: see :mod:`populora_verl.eval.sandbox`.
"""

from populora_verl.eval.backends import BACKENDS, HFBackend, Member, VLLMBackend, build_backend
from populora_verl.eval.code_grader import check_candidate, compute_expected, extract_code, outputs_match
from populora_verl.eval.data import (
    BENCHMARKS,
    CODE_BENCHMARKS,
    MATH_BENCHMARKS,
    Item,
    load_benchmark,
    register_benchmark,
    resolve_data_dir,
)
from populora_verl.eval.evaluate import evaluate, grade, summarize
from populora_verl.eval.lcb import LCBFormatError, check_lcb, decode_private_tests, load_lcb_items
from populora_verl.eval.math_grader import extract_answer, extract_boxed, math_equal, score_math
from populora_verl.eval.report import build_run_report, markdown_table, plot_lineage, population_table, write_table
from populora_verl.eval.sandbox import SandboxLimits, run_program

__all__ = [
    "BACKENDS",
    "HFBackend",
    "VLLMBackend",
    "Member",
    "build_backend",
    "check_candidate",
    "compute_expected",
    "extract_code",
    "outputs_match",
    "BENCHMARKS",
    "CODE_BENCHMARKS",
    "MATH_BENCHMARKS",
    "Item",
    "load_benchmark",
    "register_benchmark",
    "resolve_data_dir",
    "evaluate",
    "grade",
    "summarize",
    "LCBFormatError",
    "check_lcb",
    "decode_private_tests",
    "load_lcb_items",
    "extract_answer",
    "extract_boxed",
    "math_equal",
    "score_math",
    "build_run_report",
    "markdown_table",
    "plot_lineage",
    "population_table",
    "write_table",
    "SandboxLimits",
    "run_program",
]
