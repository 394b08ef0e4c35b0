"""The benchmark files that ship with the package: checksums, row counts, and the documented lookup order."""

from __future__ import annotations

import gzip
import hashlib
import re

import pytest

from populora_verl.eval.data import PACKAGE_DATA, load_benchmark, resolve_data_dir

SHIPPED = {"humaneval_plus": 164, "mbpp_plus": 378, "gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30,
           "amc23": 40}


def test_shipped_files_match_their_checksums_and_manifest():
    sums = dict(reversed(line.split("  ", 1)) for line in (PACKAGE_DATA / "SHA256SUMS").read_text().splitlines())
    manifest = (PACKAGE_DATA / "MANIFEST.md").read_text()
    assert len(sums) == len(SHIPPED)
    for rel, digest in sums.items():
        data = (PACKAGE_DATA / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, rel
        content = hashlib.sha256(gzip.decompress(data)).hexdigest()
        row = next(line for line in manifest.splitlines() if line.startswith(f"| `{rel}`"))
        assert content in row, f"{rel}: uncompressed sha256 not in MANIFEST.md"
        assert re.search(r"\| (Apache|MIT|repository MIT)", row), f"{rel}: no licence in MANIFEST.md"


def test_package_copy_is_found_without_any_setting(monkeypatch):
    monkeypatch.delenv("POPULORA_BENCHMARKS", raising=False)
    for name, n in SHIPPED.items():
        assert resolve_data_dir(None, name) == PACKAGE_DATA
        assert len(load_benchmark(name)) == n


def test_lookup_order_argument_then_environment_then_package(monkeypatch, tmp_path):
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    env_dir.mkdir(), arg_dir.mkdir()
    monkeypatch.setenv("POPULORA_BENCHMARKS", str(env_dir))
    assert resolve_data_dir(None, "gsm8k") == env_dir
    assert resolve_data_dir(arg_dir, "gsm8k") == arg_dir
    with pytest.raises(FileNotFoundError, match=r"^gsm8k: no file matching .* under " + re.escape(str(env_dir))):
        load_benchmark("gsm8k")
    with pytest.raises(FileNotFoundError, match="--data-dir: benchmark directory .* does not exist"):
        resolve_data_dir(tmp_path / "nope")
    monkeypatch.setenv("POPULORA_BENCHMARKS", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="POPULORA_BENCHMARKS="):
        resolve_data_dir(None, "gsm8k")


def test_all_skips_benchmarks_without_a_file(monkeypatch, tmp_path, capsys):
    from populora_verl.eval.cli import resolve_benchmarks

    d = tmp_path / "data"
    (d / "gsm8k").mkdir(parents=True)
    (d / "gsm8k" / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert resolve_benchmarks("math", str(d), None) == ["gsm8k"]
    assert "skipped" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_benchmarks("all", str(tmp_path / "missing"), None)
