"""The package passes verl's own ruff settings (lint and format), so a pull request to verl needs no restyling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF_VERSION = "0.12.2"  # verl's pre-commit pin


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def ruff() -> None:
    version = _ruff("--version")
    if version.returncode != 0:
        pytest.fail(f"ruff is not installed: pip install -e '.[test]' brings ruff=={RUFF_VERSION}")
    assert version.stdout.split()[-1] == RUFF_VERSION, version.stdout


def test_the_package_passes_verls_ruff_lint(ruff: None) -> None:
    r = _ruff("check", "--no-cache", "--output-format=concise", "populora_verl")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_package_is_formatted_as_verls_ruff_formats(ruff: None) -> None:
    r = _ruff("format", "--no-cache", "--check", "populora_verl")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_settings_are_verls() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for line in ('line-length = 120', 'select = ["E", "F", "UP", "B", "I", "G"]',
                 'ignore = ["F405", "F403", "E731", "B007", "UP032", "G004", "UP045", "UP035"]'):
        assert line in text, line
