"""populora_verl.bench.trace_summary: the markdown summary of a torch profiler chrome trace (a profile of one
update_actor call on the GPU is too large to bring back whole)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from populora_verl.bench import trace_summary as ts


def test_busy_time_counts_overlapping_streams_once():
    assert ts.busy_time([]) == 0
    assert ts.busy_time([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_stage_markers_get_their_gpu_busy_share_and_kernels_their_totals(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "update_actor", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "compute_log_prob", "ts": 2000, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 200},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 150, "dur": 200},  # overlaps: busy 100..350
        {"ph": "X", "cat": "kernel", "name": "softmax", "ts": 900, "dur": 200},  # half inside update_actor
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2000, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 140, "dur": 5},
        {"ph": "i", "name": "instant, ignored", "ts": 5},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = ts.summarize(ts.load_events(path))
    assert "| update_actor | 1 | 1.0 | 0.3 | 35% |" in text  # 250 µs of gemm + 100 µs of softmax inside 1 ms
    assert "| compute_log_prob | 1 | 0.1 | 0.1 | 100% |" in text
    assert "| `gemm` | 3 | 0.5 | 166.7 | 71.4% |" in text
    assert "| `aten::mm` | 2 | 0.0 |" in text


def test_a_real_cpu_trace_from_torch_profiler_and_the_cli(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("update_actor"):
            model(torch.randn(8, 16)).sum().backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert ts.main([str(path), "--out", str(tmp_path / "s.md")]) == 0
    text = (tmp_path / "s.md").read_text()
    assert "| update_actor | 1 |" in text and "aten::" in text
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    assert ts.main([str(tmp_path / "bad.json.gz")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_busy_time_inside_a_window_equals_clipping_then_merging():
    import random

    rng = random.Random(0)
    for _ in range(200):
        iv = [(s, s + rng.uniform(0, 20)) for s in (rng.uniform(0, 100) for _ in range(rng.randint(0, 15)))]
        lo, hi = sorted(rng.uniform(-10, 110) for _ in range(2))
        union = ts._union(iv)
        clipped = [(max(s, lo), min(e, hi)) for s, e in iv if min(e, hi) > max(s, lo)]
        assert ts._busy_within(union, [s for s, _ in union], lo, hi) == pytest.approx(ts.busy_time(clipped))
