"""Behavioural tests of the upstream patches (patches/*.patch) against the installed verl, on CPU.

Each test copies the installed ``verl`` package into a temporary folder, applies one patch there (or none), and runs a
check in a fresh interpreter with that copy first on ``sys.path``, so the copy's modules, not the installed ones, are
imported. Every check runs three times: on the pristine copy it must fail (the patch fixes something real); with the
patch alone, and with the whole series applied in order, it must pass.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _shared import REPO

VERL = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
PATCHES = REPO / "patches"


def verl_copy(dest: Path, *patches: str) -> Path:
    """A copy of the installed verl under ``dest`` with ``patches`` (file names in patches/) applied in order."""
    shutil.copytree(VERL, dest / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in patches:
        res = subprocess.run(["patch", "-p1", "--forward", "-s", "-i", str(PATCHES / name)], cwd=dest,
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{name} does not apply: {res.stdout}{res.stderr}"
    return dest


def start_check(root: Path, code: str) -> subprocess.Popen:
    """Start ``code`` in a fresh interpreter that imports verl from ``root`` (it asserts that it imported the copy);
    :func:`finish_check` collects it."""
    prelude = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {str(root)!r})
        import verl
        assert verl.__file__.startswith({str(root)!r}), verl.__file__
    """)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "RAY_DEDUP_LOGS": "0"}
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_check(proc: subprocess.Popen, timeout: int = 240) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_check(root: Path, code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports verl from ``root``; asserts it imported the copy."""
    return finish_check(start_check(root, code), timeout)


def series() -> list[str]:
    """Every patch of patches/, in order (they apply one after another as well as each on its own)."""
    return sorted(p.name for p in PATCHES.glob("*.patch"))


@pytest.fixture(scope="session")
def series_copy(tmp_path_factory):
    """verl with the whole series applied, shared by the tests."""
    if shutil.which("patch") is None:
        pytest.skip("`patch` not installed")
    return verl_copy(tmp_path_factory.mktemp("series"), *series())


@pytest.fixture
def fails_without_passes_with(tmp_path, series_copy):
    """``check(patch, code)``: ``code`` fails against pristine verl, and passes with ``patch`` applied alone and with
    the whole series applied."""

    def check(patch: str, code: str, *, expect_without: str | None = None) -> str:
        # The three interpreters are independent (each its own copy of verl, no shared socket, port or file), and
        # most of their time is importing verl: they run side by side.
        roots = (verl_copy(tmp_path / "pristine"), verl_copy(tmp_path / "patched", patch), series_copy)
        procs = [start_check(root, code) for root in roots]
        try:
            pristine, patched, together = (finish_check(proc) for proc in procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert pristine.returncode != 0, f"passes without {patch}: the check does not test the patch\n{pristine.stdout}"
        if expect_without is not None:
            assert expect_without in pristine.stderr + pristine.stdout, pristine.stderr[-3000:]
        assert patched.returncode == 0, f"fails with {patch}:\n{patched.stdout[-2000:]}\n{patched.stderr[-4000:]}"
        assert together.returncode == 0, f"fails with the series:\n{together.stdout[-2000:]}\n{together.stderr[-4000:]}"
        return patched.stdout

    return check


@pytest.fixture
def check_against(tmp_path, series_copy):
    """``check(code, patches=None)``: ``code`` run against verl with the whole series applied (``patches`` None) or
    with only ``patches`` (names in patches/, none: pristine); returns the finished process, for checks of the plugin
    that are not a patch's own."""

    def check(code: str, patches: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
        root = series_copy if patches is None else verl_copy(tmp_path / "copy", *patches)
        return run_check(root, code)

    return check
