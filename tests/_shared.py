"""Plain helpers the test modules import (conftest.py puts this folder on sys.path).

Fixtures live in conftest.py; what is here is needed outside a test's arguments: in module-level helpers and in
values a module builds at import time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# Paths from here, never from a test module's own __file__: the modules sit one folder down (tests/<area>/), and
# a later move of a module must not change what these name.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"
RECIPES = REPO / "recipes" / "populora"


def compose_recipe(name: str, overrides=(), *, hydra_config: bool = False):
    """The recipe ``name`` composed by hydra as ``verl.trainer.main_ppo --config-path recipes/populora`` would.

    ``hydra_config``: keep the ``hydra`` node (callbacks and the like), which a plain compose drops."""
    # Imported here: some modules skip themselves when hydra is missing, which they can only do before this runs.
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=name, overrides=list(overrides), return_hydra_config=hydra_config)


# --- a small population step: one code_o task type, answers written by the test ----------------------------------

PROGRAM = "def f(x):\n    return x + 1\n"
GOOD_PROPOSAL = f"plan</think>\n<answer>\n```python\n{PROGRAM}```\n```input\n3\n```\n</answer>"
GARBAGE = "no idea what to write"
RIGHT = "4 it is</think>\n<answer>\n```output\n4\n```\n</answer>"
WRONG = "maybe 5</think>\n<answer>\n```output\n5\n```\n</answer>"


def small_step_config(proposals_per_type: int = 1, **over):
    """2T2S on code_o with round-robin matchmaking, evolution every step and a small CVT archive; ``over`` merges
    into a section (``pbt={"enabled": False}``)."""
    from populora_verl.config import load_config

    base = {
        "population": {"num_teachers": 2, "num_students": 2},
        "matchmaking": {"method": "round_robin"},
        "tasks": {"types": ["code_o"], "num_references": 1},
        "rollout": {"teacher_n": 1, "student_n": 4, "proposals_per_type": proposals_per_type},
        "pbt": {"interval_steps": 1},
        "diagnostics": {"cvt_cells": 8, "cvt_samples": 500},
    }
    for k, v in over.items():
        base.setdefault(k, {}).update(v)
    return load_config(base)


def answer_with(requests, fn):
    """One response per request: ``fn(request, k)`` for each of its ``request.n`` completions."""
    from populora_verl.step import GenResponse

    return [GenResponse(r, [fn(r, k) for k in range(r.n)], lengths=[5] * r.n) for r in requests]


class FakeRollout:
    """The worker's rollout side without vLLM: records every weight push."""

    def __init__(self):
        self.pushes = []
        self.sleep_level = 2

    async def resume(self, tags):
        pass

    async def update_weights(self, weights, **kwargs):
        self.pushes.append(({k: v.clone() for k, v in weights}, kwargs))


def bare_worker(training_worker, *, base_sync_done: bool = False):
    """PopuLoRA's actor worker built with ``__new__`` around a fake verl training worker (verl's FSDP engine and
    vLLM are GPU-only), with a :class:`FakeRollout`."""
    from omegaconf import OmegaConf

    from populora_verl.workers.worker import PopuLoRAActorRolloutRefWorker

    w = PopuLoRAActorRolloutRefWorker.__new__(PopuLoRAActorRolloutRefWorker)
    w.config = OmegaConf.create({"actor": {"strategy": "fsdp2"},
                                 "rollout": {"checkpoint_engine": {"backend": "naive"}, "free_cache_engine": False}})
    w.role = "actor_rollout"
    w.actor = training_worker
    w.rollout = FakeRollout()
    w.enable_routing_replay = False
    w.base_sync_done = base_sync_done
    w.layered_summon = False
    w.peft_merge = False
    w._rank, w._world_size = 0, 1
    return w


#: The start of a script that drives verl's own trainer on the CPU in a fresh interpreter: verl's trainer classes, a
#: private temporary folder (removed at exit) and an ``events`` list for the script's recorders.
TRAINER_SCRIPT_PRELUDE = """
import atexit, os, shutil, tempfile
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

root = tempfile.mkdtemp()
tempfile.tempdir = root  # verl's checkpoint lock files too: the test leaves nothing in /tmp, failed or not
atexit.register(shutil.rmtree, root, True)
events = []
"""

#: verl's trainer workers and dataloader replaced by recorders of what verl's save and resume do with them (the step
#: folder each call names), for the checks that run verl's real ``_save_checkpoint`` / ``_load_checkpoint`` on CPU.
TRAINER_RECORDERS = """

class Workers:
    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)
        events.append(("actor saved", os.path.basename(os.path.dirname(local_path))))
    def load_checkpoint(self, local_path, **kwargs):
        events.append(("actor loaded", os.path.basename(os.path.dirname(local_path))))

class Loader:
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass

def recording_trainer(cls, mode):
    # a cls (registered as mode) on verl's default config, saving under root, with the recorders
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[f"trainer.v1.trainer_mode={mode}",
                                                           f"trainer.default_local_dir={root}"])
    t = cls(cfg)
    t.trainer_mode, t.is_async = "sync", False  # a sync trainer under its own name (patch 0007 or not)
    t.actor_rollout_wg, t.train_dataloader, t.use_critic = Workers(), Loader(), False
    return t
"""


def needs_vllm(what: str) -> pytest.MarkDecorator:
    """Skip a test that calls into vLLM itself (``what``: the part it uses) where vLLM is not installed."""
    return pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                              reason=f"needs vLLM ({what}); runs where vLLM is installed")


# --- fresh interpreters side by side -----------------------------------------------------------------------------


class SideBySide:
    """Independent programs started at once: ``jobs`` maps a name to ``subprocess.run`` keyword arguments (``args``
    included; output captured as text unless they say otherwise), as many running at a time as this machine has CPUs
    (two at least); :meth:`result` waits for one. Only for programs that share nothing that one could change under
    another (no fixed port, file or environment variable between them).

    For a module whose tests each check a fresh interpreter (most of whose time is importing verl on one core): a
    module-scoped fixture starts them all, each test asserts on its own (:func:`run_side_by_side` waits for all of
    them; with :func:`start_early` they start with the module, beside its in-process tests)."""

    def __init__(self, jobs: dict, timeout: float = 300) -> None:
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=max(2, cpus))
        self._futures = {name: self._pool.submit(self._run, dict(kw), timeout) for name, kw in jobs.items()}

    def _run(self, kwargs: dict, timeout: float):
        """One job, as ``subprocess.run`` would run it; its exception (a timeout) is returned for its test to raise."""
        args = kwargs.pop("args")
        kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
        with self._lock:
            if self._closed:
                return RuntimeError("not run: its module ended before its turn")
            try:
                proc = subprocess.Popen(args, **kwargs)
            except Exception as e:
                return e
            self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            e.output, e.stderr = proc.communicate()
            return e
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    def result(self, name) -> subprocess.CompletedProcess:
        """The finished process of job ``name`` (waits for it), or the exception that ended its run, raised."""
        return finished(self._futures[name].result())

    def results(self) -> dict:
        """name -> the finished process, or the exception that ended its run (:func:`finished` raises it)."""
        return {name: f.result() for name, f in self._futures.items()}

    def close(self) -> None:
        """Stop what still runs (a job whose test was not run) and wait for the rest."""
        with self._lock:
            self._closed = True
            running = [p for p in self._procs if p.poll() is None]
        for proc in running:
            proc.kill()
        self._pool.shutdown(wait=True)


def run_side_by_side(jobs: dict, timeout: float = 300) -> dict:
    """:class:`SideBySide` run to its end: name -> the finished process, or the exception that ended the run."""
    runs = SideBySide(jobs, timeout)
    try:
        return runs.results()
    finally:
        runs.close()


def start_early(request, fixture: str) -> None:
    """In an autouse module-scoped fixture: set up the module-scoped ``fixture`` (one that starts a
    :class:`SideBySide`) as the module starts, so that its programs run beside the module's in-process tests; only
    where a selected test of the module uses it."""
    if any(fixture in item.fixturenames for item in request.session.items if item.module is request.module):
        request.getfixturevalue(fixture)


def finished(result) -> subprocess.CompletedProcess:
    """One job's result: its finished process, or the exception that ended its run, raised."""
    if isinstance(result, BaseException):
        raise result
    return result


# --- a fork server: many programs that begin with the same import --------------------------------------------------


class ForkServer:
    """An interpreter that has run ``prelude`` (in ``cwd``, with environment ``env``) and forks a child per program
    that begins with it, one at a time (tests/_forkserver.py says what the child has of a fresh interpreter).

    Started at once, the prelude runs in the background. :meth:`serves` says whether ``python -c code`` may be forked
    now (else the caller runs a fresh interpreter), :meth:`start` forks it; :meth:`close` ends the server. Where the
    prelude left a thread behind or failed, the server never serves: every program runs fresh."""

    def __init__(self, prelude: str, *, cwd, env: dict[str, str]) -> None:
        assert prelude.endswith("\n"), "the program's own lines begin on a line of their own"
        self.prelude, self.cwd, self.env = prelude, Path(cwd), dict(env)
        self.why_not: str | None = None  # why it does not serve, once known
        self._ready = self._ended = self._busy = False
        self._dir = Path(tempfile.mkdtemp(prefix="populora-forkserver-"))
        self._n = 0
        out, err = self._dir / "prelude.stdout", self._dir / "prelude.stderr"
        self._prelude_output: tuple[str, str] | None = None
        self._log = open(self._dir / "server.log", "w+")  # noqa: SIM115  (closed in close())
        boot = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import _forkserver; "
                f"_forkserver.serve({prelude!r}, {str(TESTS)!r}, {str(out)!r}, {str(err)!r})")
        # a session of its own: stop() ends the server and the program it runs, and nothing else, by its group
        self.proc = subprocess.Popen([sys.executable, "-c", boot], cwd=self.cwd, env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, start_new_session=True)

    def _receive(self, timeout: float | None):
        """The server's next message; None where none came within ``timeout``; RuntimeError where it ended."""
        import select

        import _forkserver

        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return None
        msg = _forkserver.receive(fd)  # a message is written at once, and is short: the rest follows
        if msg is None:
            self.proc.wait()
            self._log.seek(0)
            raise RuntimeError(f"the fork server in {self.cwd} ended ({self.proc.returncode}): "
                               f"{self._log.read()[-4000:]}")
        return msg

    @staticmethod
    def _same(env: dict[str, str], other: dict[str, str]) -> bool:
        # pytest names the running test in PYTEST_CURRENT_TEST, which the child gets; every other variable must be
        # as the server had it when it ran the prelude
        return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"} == {
            k: v for k, v in other.items() if k != "PYTEST_CURRENT_TEST"
        }

    def serves(self, code: str, env: dict[str, str], timeout: float = 600) -> bool:
        """Whether ``python -c code`` with environment ``env`` (in ``cwd``) may be forked now: it begins with the
        prelude, its environment is the server's, the server has run the prelude (waits for it up to ``timeout``
        seconds) and is free."""
        if self.why_not is not None or self._busy or not code.startswith(self.prelude) or not self._same(env, self.env):
            return False
        if not self._ready:
            try:
                msg = self._receive(timeout)
            except RuntimeError as e:
                msg = {"ready": False, "why": str(e)}
            if msg is None:
                msg = {"ready": False, "why": f"no prelude within {timeout:.0f} s"}
                self.stop()
            if not msg["ready"]:
                self.why_not, self._ended = msg["why"], True  # it ends by itself
                return False
            self._ready = True
            out, err = self._dir / "prelude.stdout", self._dir / "prelude.stderr"
            self._prelude_output = (out.read_text(), err.read_text())
        return self.proc.poll() is None

    def start(self, code: str, env: dict[str, str]) -> Forked:
        """Fork ``python -c code`` (where :meth:`serves` said yes)."""
        import _forkserver

        assert self._ready and not self._busy and code.startswith(self.prelude)
        self._n += 1
        out, err = self._dir / f"{self._n}.stdout", self._dir / f"{self._n}.stderr"
        self._busy = True
        try:
            _forkserver.send(self.proc.stdin.fileno(), {"code": code[len(self.prelude) :], "env": dict(env),
                                                         "stdout": str(out), "stderr": str(err)})
        except BaseException:
            self.stop()
            raise
        return Forked(self, [sys.executable, "-c", code], out, err)

    def stop(self) -> None:
        """End the server and the program it runs now (its session: what they started in sessions of their own
        lives on, as it would after a fresh interpreter was killed); from now on it serves no one."""
        self.why_not = self.why_not or "stopped"
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its group: the server holds it until it is reaped
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._busy = False

    def close(self) -> None:
        """End the server: told to where it waits for a program (stopped if it has not ended within 60 s), else
        stopped."""
        import _forkserver

        if (self._ready or self._ended) and not self._busy and self.proc.poll() is None:
            try:
                if self._ready:
                    _forkserver.send(self.proc.stdin.fileno(), {"quit": True})
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.stop()
        self.proc.stdout.close()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class Forked:
    """A program forked by a :class:`ForkServer`, which runs nothing else until it has ended."""

    def __init__(self, server: ForkServer, args: list[str], out: Path, err: Path) -> None:
        self.server, self.args, self.out, self.err = server, args, out, err
        self.done = False

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for its end: the finished process as ``subprocess.run`` would give that of ``python -c code``."""
        try:
            msg = self.server._receive(timeout)
        except BaseException:
            self.stop()
            raise
        if msg is None:
            self.stop()
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.done, self.server._busy = True, False
        before_out, before_err = self.server._prelude_output
        res = subprocess.CompletedProcess(self.args, msg["rc"], before_out + self.out.read_text(),
                                          before_err + self.err.read_text())
        self.out.unlink()
        self.err.unlink()
        return res

    def stop(self) -> None:
        """Stop it where it still runs (and with it the server, which serves no one after)."""
        if not self.done:
            self.done = True
            self.server.stop()
