"""With the whole series (patches/) applied, the plugin uses verl's public APIs instead of the private names and runtime
patches that populora_verl/verl_private.py records as replaced (``series_api``), and its verl-facing tests pass.

The copy of verl comes first on the path of a fresh interpreter, and ``POPULORA_VERL_PUBLIC_ONLY=1`` makes every such
private path raise (``verl_compat.private_path``); a method the plugin overrides only for verl 0.9.1 must not exist
on its class at all. Without the series the plugin takes today's path (the rest of the suite, against verl 0.9.1).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from populora_verl import verl_compat, verl_private

from _shared import REPO, finished, run_side_by_side

STANDIN = (REPO / "tests" / "patches" / "_vllm_standin.py").read_text(encoding="utf-8")

#: The tests that exercise the attachment points the series replaces, all on CPU: the trainer's set-up (mode,
#: replay buffer with its poll interval and refill, worker class, no dataset), the rollout and agent-loop
#: registrations, the agent loop's prompt cap, the plugin's start-up checks, the weight-sync socket, the log-prob
#: fallback, the resident engine's class and micro-batches, the reward manager's class setup, and, against
#: TransferQueue, the prompts' hand-off to the agent loop and the step's stages (balancing, old log-probs, the per-slot
#: and the fused update with the actor mesh's data-parallel size).
#: Two pytest runs side by side, each about half of the time (most of it on one core).
VERL_FACING_RUNS = (
    ("tests/trainer/test_trainer_tq.py", "tests/trainer/test_trainer.py", "tests/rollout"),
    ("tests/workers/test_logprobs.py", "tests/project/test_plugin.py", "tests/workers/test_resident_verl_engine.py",
     "tests/reward/test_reward_manager.py"),
)

FLAGS = verl_compat.SERIES_DETECTORS


def _public_only_env(root) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, verl_compat.PUBLIC_ONLY_ENV: "1", "PYTHONDONTWRITEBYTECODE": "1",
            "TORCH_COMPILE_DISABLE": "1", "RAY_AUTH_MODE": "disabled"}


def test_verl_091_takes_the_private_path_and_the_guard_trips():
    """Against the installed verl 0.9.1 every check answers no, and the guard raises only when asked to."""
    assert not any(getattr(verl_compat, f)() for f in FLAGS)
    verl_compat.private_path("_ROLLOUT_REGISTRY")  # no env: a no-op
    env = {**os.environ, verl_compat.PUBLIC_ONLY_ENV: "1"}
    res = subprocess.run([sys.executable, "-c", "from populora_verl import verl_compat as c; "
                          "c.private_path('_ROLLOUT_REGISTRY')"], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "PrivateVerlUse" in res.stderr


def test_every_replaced_private_path_is_guarded():
    """Each entry with a ``series_api`` is either a method defined only for verl 0.9.1 or guarded where it is used."""
    for e in verl_private.PRIVATE:
        if e.series_api and any(kind != "override" for kind, _ in e.uses):
            for _, module in e.uses:
                src = (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8") \
                    if (REPO / (module.replace(".", "/") + ".py")).exists() \
                    else (REPO / module.replace(".", "/") / "__init__.py").read_text(encoding="utf-8")
                assert f'private_path("{e.name}")' in src, (e.name, module)
    for rp in verl_private.RUNTIME_PATCHES:
        if rp.series_api:
            src = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "populora_verl").rglob("*.py"))
            assert f'private_path("{rp.module}")' in src, rp.module


CHECK = f"""
import importlib, inspect
from populora_verl import plugin, verl_compat, verl_private

flags = {FLAGS!r}
assert all(getattr(verl_compat, f)() for f in flags), {{f: getattr(verl_compat, f)() for f in flags}}
plugin.check_registrations()  # every registration went through the public API (a private path would have raised)

# the vLLM-side modules import vLLM, which the CPU machine lacks: a stand-in from here on (registrations are done)
exec({STANDIN!r})

# overrides of private verl methods that the series makes unnecessary are not defined at all
for e in verl_private.PRIVATE:
    for kind, module in e.uses:
        if e.series_api and kind == "override":
            mod = importlib.import_module(module)
            owners = [c for _, c in inspect.getmembers(mod, inspect.isclass)
                      if c.__module__ == module and e.name in vars(c)]
            assert not owners, (e.name, owners)

from populora_verl.rollout import VERL_SERVER_ADAPTER_FQN, server_adapter_fqn
from verl.workers.rollout.base import get_rollout_class  # noqa: F401  (public)
assert server_adapter_fqn() == VERL_SERVER_ADAPTER_FQN
print("ok")
"""


def test_the_plugin_takes_the_public_path_with_the_series(series_copy):
    code = f"import verl\nassert verl.__file__.startswith({str(series_copy)!r}), verl.__file__\n" + CHECK
    res = subprocess.run([sys.executable, "-c", code], env=_public_only_env(series_copy), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


@pytest.mark.slow
def test_verl_facing_tests_pass_against_the_series(series_copy):
    env = _public_only_env(series_copy)
    where = subprocess.run([sys.executable, "-c", "import verl; print(verl.__file__)"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert where.stdout.strip().startswith(str(series_copy)), where.stdout + where.stderr[-2000:]
    runs = run_side_by_side({i: {"args": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                                 "env": env, "cwd": REPO} for i, paths in enumerate(VERL_FACING_RUNS)}, timeout=1200)
    for i, paths in enumerate(VERL_FACING_RUNS):
        res = finished(runs[i])
        assert res.returncode == 0, f"{' '.join(paths)}:\n" + res.stdout[-6000:] + res.stderr[-3000:]
