"""Fixtures shared by the test modules: sandboxed executors and a PopuLoRATrainer built without verl."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The importlib import mode (pyproject.toml) leaves sys.path alone, and this folder must never be importable as
# `tests` (verl's wheel owns that name): appended, so that `import _shared` works and shadows nothing installed.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)


def _parse_each_config_text_once() -> None:
    """Hydra reads every config file of a recipe (verl's ppo_trainer and its ~25 parts) on every compose, through
    ``OmegaConf.load`` of the open file, and parsing that YAML is half of each compose's time; the tests compose a few
    hundred times. Here a text that was parsed before gives a deep copy of what its parse gave (each call its own
    object, as before), so a change to a file on disk is seen at once; any other call, a first parse and an error are
    ``OmegaConf.load`` itself. Only this process (the tests' own interpreters parse for themselves)."""
    import copy

    from omegaconf import OmegaConf

    load = OmegaConf.load
    parsed: dict = {}

    def cached_load(file_):
        seekable = getattr(file_, "seekable", None)
        if isinstance(file_, (str, Path)) or not (callable(seekable) and seekable()):
            return load(file_)
        start = file_.tell()
        text = file_.read()
        file_.seek(start)
        key = (type(text), text)
        if key in parsed:
            return copy.deepcopy(parsed[key])
        cfg = load(file_)
        parsed[key] = copy.deepcopy(cfg)
        return cfg

    OmegaConf.load = staticmethod(cached_load)


try:
    _parse_each_config_text_once()
except ImportError:  # omegaconf not installed: the modules that need it skip themselves
    pass


class ExecutorPool:
    """One executor per (timeout_s, memory_mb, max_workers), started on first use, closed at the session's end.

    Each executor starts a process per slot, so modules with the same limits share one. Only for tests that leave
    the executor as they found it: a worker that dies is replaced on its next call, but tests that kill, restart or
    count workers, or change the environment the workers start in, keep an executor of their own."""

    def __init__(self) -> None:
        self._executors: dict[tuple[float, int, int], object] = {}

    def get(self, *, timeout_s: float, memory_mb: int, max_workers: int):
        from populora_verl.executor import Executor

        key = (float(timeout_s), int(memory_mb), int(max_workers))
        if key not in self._executors:
            self._executors[key] = Executor(timeout_s=timeout_s, memory_mb=memory_mb, max_workers=max_workers)
        return self._executors[key]

    def close(self) -> None:
        for ex in self._executors.values():
            ex.close()
        self._executors.clear()


@pytest.fixture(scope="session")
def ray_tmpdir():
    """Where the tests' Ray clusters keep their sessions (ray.init's ``_temp_dir``, or ``RAY_TMPDIR`` for a child),
    removed at the end: Ray's default, /tmp/ray, keeps every session folder. Not under pytest's numbered folders:
    Ray's socket paths (``<dir>/session_<date>_<pid>/sockets/plasma_store``) must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="populora-ray-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def executor_pool():
    pool = ExecutorPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def executor(executor_pool):
    """The executor of the population-step modules (step, task loop, selection, resume); one slot is enough for
    their hand-written programs."""
    return executor_pool.get(timeout_s=5.0, memory_mb=256, max_workers=1)


@pytest.fixture
def bare_trainer():
    """Builds a PopuLoRATrainer without its constructor: ``bare_trainer(config, **attributes)``.

    verl's constructor needs a whole verl config and ours also validates the GPU layout and builds a
    PopulationStep; a test of one trainer method sets just what that method reads (the attributes, set before
    the trainer's own state is initialised)."""

    def build(config, **attributes):
        from populora_verl.trainer import register

        cls = register()
        t = cls.__new__(cls)
        t.config = config
        for name, value in attributes.items():
            setattr(t, name, value)
        t._init_populora_state()
        return t

    return build
