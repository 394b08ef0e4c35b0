"""Behavioural tests of the upstream patches (patches/*.patch) against the installed verl, on CPU.

Each test copies the installed ``verl`` package into a temporary folder, applies one patch there (or none), and runs a
check in a fresh interpreter with that copy first on ``sys.path``, so the copy's modules, not the installed ones, are
imported. Every check runs three times: on the pristine copy it must fail (the patch fixes something real); with the
patch alone, and with the whole series applied in order, it must pass.

The pristine copy and the series' copy are the same for every test: one of each serves the session (what a check
writes into its folder, as the checks that write a module of their own there, is written the same by every run). A
check's program is the prelude that imports verl from its copy, then the check's code: on those two copies a process
that has run the prelude forks the interpreter that runs the code (tests/_forkserver.py: the child is where a fresh
``python -c`` of the whole program would be after the prelude, output included), which spares two of each test's
three ``import verl``. The copy with one patch is the test's own, checked in a fresh interpreter; so is any check
whose environment differs from the server's, or that starts while the server runs another.
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

from _shared import REPO, ForkServer

VERL = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
PATCHES = REPO / "patches"


def verl_copy(dest: Path, *patches: str) -> Path:
    """A copy of the installed verl under ``dest`` with ``patches`` (file names in patches/) applied in order.

    The installed bytecode comes along (``__pycache__``): a check's interpreter, which writes none, need not compile
    verl again. A ``.pyc`` is used only for a source of the size and modification time it records (copied with the
    source), and that of every file a patch touches is removed all the same: those files are compiled afresh."""
    shutil.copytree(VERL, dest / "verl")
    for name in patches:
        res = subprocess.run(["patch", "-p1", "--forward", "-s", "-i", str(PATCHES / name)], cwd=dest,
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{name} does not apply: {res.stdout}{res.stderr}"
        for line in (PATCHES / name).read_text(encoding="utf-8").splitlines():
            if line.startswith("+++ b/") and line.endswith(".py"):
                source = dest / line[len("+++ b/") :]
                for pyc in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
                    pyc.unlink()
    return dest


def _prelude(root: Path) -> str:
    """What every check runs first: verl imported from ``root`` (asserted)."""
    return textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {str(root)!r})
        import verl
        assert verl.__file__.startswith({str(root)!r}), verl.__file__
    """)


def _check_env() -> dict[str, str]:
    """The environment of a check's interpreter (read at each start: a test may have changed ``os.environ``)."""
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "RAY_DEDUP_LOGS": "0"}


class _Fresh:
    """A check in a fresh interpreter."""

    def __init__(self, root: Path, code: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def verl_server(root: Path) -> ForkServer:
    """A :class:`ForkServer` that has run the checks' prelude on ``root``, in the folder and environment of a check on
    ``root``."""
    return ForkServer(_prelude(root), cwd=root, env=_check_env())


def start_check(root: Path, code: str, server: ForkServer | None = None):
    """Start ``code`` in an interpreter that imports verl from ``root`` (it asserts that it imported the copy): forked
    by ``server`` (a :func:`verl_server` of ``root``) where it serves, else fresh; :func:`finish_check` collects it."""
    env, program = _check_env(), _prelude(root) + textwrap.dedent(code)
    if server is not None and server.serves(program, env):
        assert server.cwd == root
        return server.start(program, env)
    return _Fresh(root, program, env)


def run_checks(jobs, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """Each ``(root, code, server)`` of ``jobs`` started as :func:`start_check` starts it, all side by side (the jobs
    are read one by one, so a job may make its copy of verl while the earlier ones run); the finished processes, in
    order. What still runs when one fails is stopped."""
    started = []
    try:
        for root, code, server in jobs:
            started.append(start_check(root, code, server))
        return [check.result(timeout) for check in started]
    finally:
        for check in started:
            check.stop()


def series() -> list[str]:
    """Every patch of patches/, in order (they apply one after another as well as each on its own)."""
    return sorted(p.name for p in PATCHES.glob("*.patch"))


@pytest.fixture(scope="session")
def series_copy(tmp_path_factory):
    """verl with the whole series applied, shared by the tests."""
    if shutil.which("patch") is None:
        pytest.skip("`patch` not installed")
    return verl_copy(tmp_path_factory.mktemp("series"), *series())


@pytest.fixture(scope="session")
def pristine_copy(tmp_path_factory):
    """verl as installed, copied once for the session (the checks only read it)."""
    return verl_copy(tmp_path_factory.mktemp("pristine"))


@pytest.fixture(scope="session")
def fork_servers(series_copy, pristine_copy):
    """A :class:`ForkServer` for the series' copy and one for the pristine copy, started at once (each imports verl
    in the background), ended with the session."""
    servers = {root: verl_server(root) for root in (series_copy, pristine_copy)}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture
def fails_without_passes_with(tmp_path, series_copy, pristine_copy, fork_servers):
    """``check(patch, code)``: ``code`` fails against pristine verl, and passes with ``patch`` applied alone and with
    the whole series applied."""

    def check(patch: str, code: str, *, expect_without: str | None = None) -> str:
        # The three checks are independent (each its own interpreter on its own copy of verl, no shared socket, port
        # or file), and most of their time is importing verl: they run side by side, two of them forked.
        patched, pristine, together = run_checks([
            (verl_copy(tmp_path / "patched", patch), code, None),
            *((root, code, fork_servers[root]) for root in (pristine_copy, series_copy)),
        ])
        assert pristine.returncode != 0, f"passes without {patch}: the check does not test the patch\n{pristine.stdout}"
        if expect_without is not None:
            assert expect_without in pristine.stderr + pristine.stdout, pristine.stderr[-3000:]
        assert patched.returncode == 0, f"fails with {patch}:\n{patched.stdout[-2000:]}\n{patched.stderr[-4000:]}"
        assert together.returncode == 0, f"fails with the series:\n{together.stdout[-2000:]}\n{together.stderr[-4000:]}"
        return patched.stdout

    return check


def _root(patches: tuple[str, ...] | None, series_copy: Path, pristine_copy: Path, new_folder) -> Path:
    """The copy of verl a check of ``patches`` runs on: the series' (None), the pristine one (none), or a new copy in
    ``new_folder()`` with ``patches`` applied."""
    if patches is None:
        return series_copy
    return verl_copy(new_folder(), *patches) if patches else pristine_copy


@pytest.fixture(scope="session")
def checks_against(tmp_path_factory, series_copy, pristine_copy, fork_servers):
    """``checks([(code, patches), ...])``: each ``code`` run against verl with the whole series applied (``patches``
    None) or with only ``patches`` (names in patches/, none: pristine), all started side by side (for a module-scoped
    fixture whose tests each assert on one of them); the finished processes, in order. For checks of the plugin that
    are not a patch's own."""

    def jobs(pairs):
        for code, patches in pairs:
            root = _root(patches, series_copy, pristine_copy, lambda: tmp_path_factory.mktemp("copy"))
            yield root, code, fork_servers.get(root)

    return lambda pairs: run_checks(jobs(pairs))


@pytest.fixture
def check_against(checks_against):
    """``check(code, patches=None)``: :func:`checks_against` for one program; its finished process."""

    def check(code: str, patches: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
        return checks_against([(code, patches)])[0]

    return check
