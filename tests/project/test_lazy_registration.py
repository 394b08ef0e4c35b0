"""The plugin registers each entry when its process imports the verl module that holds the registry, not at
``import verl`` (populora_verl/import_hooks.py, populora_verl/plugin.py): what ``import verl`` leaves out, that
each registry gets its entry once imported, the hook's own contract on a package of its own, and the failure line."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from _shared import REPO, ForkServer, SideBySide, finished

from populora_verl import import_hooks
from populora_verl.import_hooks import AfterImportFinder

#: What ``import verl`` must not import any more (the trainer's stack, the agent loop, the registries' modules).
NOT_AT_IMPORT = (
    "populora_verl.trainer.trainer",
    "verl.trainer.ppo.v1",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.ppo.core_algos",
    "verl.experimental.agent_loop",
    "verl.experimental.agent_loop.agent_loop",
    "verl.experimental.reward_loop.reward_manager",
    "verl.workers.rollout",
)


def _job(code: str, **env: str) -> dict:
    """``code`` for a fresh interpreter (``subprocess.run`` arguments), the plugin loaded by its entry point unless
    ``env`` says otherwise."""
    full = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto", "RAY_AUTH_MODE": "disabled", **env}
    full.pop("VERL_USE_EXTERNAL_MODULES", None)
    return {"args": [sys.executable, "-c", textwrap.dedent(code)], "env": full, "cwd": REPO}


def _state(out) -> dict:
    """The JSON that a child of :func:`_job` printed on its last line (it must have succeeded)."""
    out = finished(out)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


#: How the programs below that begin with ``import verl`` (the plugin loaded by its entry point) begin: what the fork
#: server of :func:`children` runs once.
IMPORT_VERL = "import json, sys\nimport verl\n"

IMPORT_VERL_ALONE = IMPORT_VERL + textwrap.dedent(f"""
    from populora_verl import import_hooks, plugin
    from populora_verl.import_hooks import AfterImportFinder
    state = {{"loaded": "populora_verl.plugin" in sys.modules,
              "imported": [m for m in {NOT_AT_IMPORT!r} if m in sys.modules],
              "pending": sorted(plugin._pending), "watched": sorted(import_hooks.pending()),
              "finder": any(isinstance(f, AfterImportFinder) for f in sys.meta_path)}}
    plugin.check_registrations()  # imports the registry modules: every hook fires
    state.update(after_pending=sorted(plugin._pending), after_watched=import_hooks.pending(), errors=plugin._errors,
                 after_finder=any(isinstance(f, AfterImportFinder) for f in sys.meta_path),
                 registered=plugin.registered())
    print(json.dumps(state))
""")

#: (what, code run after ``import verl`` that imports one registry module and asserts our entry is in it, modules
#: that this import must leave out). Each reads the registry the way verl does, not through the plugin's checks.
REGISTRY_READS = {
    "trainer": ("from verl.trainer.ppo.v1 import get_trainer_cls\nget_trainer_cls('populora')\n", ()),
    "trainer_base": ("import verl.trainer.ppo.v1.trainer_base as tb\nassert 'populora' in tb.TRAINER_REGISTRY\n", ()),
    "adv_estimator": (
        "from verl.trainer.ppo.core_algos import get_adv_estimator_fn\nget_adv_estimator_fn('populora_trrpp')\n",
        ("populora_verl.trainer.trainer", "verl.experimental.agent_loop"),
    ),
    "reward_manager": (
        "from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls\n"
        "get_reward_manager_cls('populora_code')\n",
        ("populora_verl.trainer.trainer",),
    ),
    "rollout_base": (  # an FSDP worker: the trainer-side class is all it reads
        "import verl.workers.rollout.base\nfrom populora_verl.rollout import rollout_registered\n"
        "assert rollout_registered('populora_vllm')\n",
        ("populora_verl.trainer.trainer", "verl.experimental.agent_loop"),
    ),
    "agent_loop": (
        "import verl.experimental.agent_loop.agent_loop as al\n"
        "from populora_verl.rollout import agent_loop_registered\n"
        "assert agent_loop_registered(al, 'populora_agent')\n",
        ("populora_verl.trainer.trainer",),
    ),
}


def _registry_read(case: str) -> str:
    read, left_out = REGISTRY_READS[case]
    return (
        IMPORT_VERL
        + "from populora_verl import plugin\n"
        + read
        + f"print(json.dumps({{'errors': plugin._errors, 'pending': sorted(plugin._pending), "
        f"'imported': [m for m in {left_out!r} if m in sys.modules]}}))\n"
    )


REGISTRY_BEFORE_PLUGIN = """
    import json
    import verl  # no plugin: VERL_USE_EXTERNAL_PLUGINS=none
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    assert "populora_trrpp" not in ADV_ESTIMATOR_REGISTRY
    from populora_verl import plugin
    print(json.dumps({"in": "populora_trrpp" in ADV_ESTIMATOR_REGISTRY, "pending": sorted(plugin._pending),
                      "errors": plugin._errors}))
"""

FAILING_REGISTER = IMPORT_VERL + textwrap.dedent("""
    import populora_verl.advantage as adv
    from populora_verl import plugin

    def broken():
        raise ValueError("no estimator today")

    adv.register = broken
    import verl.trainer.ppo.core_algos  # the registration fails: the import itself goes on
    errors = dict(plugin._errors)
    try:
        plugin.check_registrations()
    except RuntimeError as e:
        message = str(e)
    else:
        message = None
    print(json.dumps({"errors": errors, "message": message}))
""")

# our trainer imports verl's trainer package, whose end would register ``populora`` from our package while that
# package is still executing (its register() not defined yet): it waits, no warning, and the check registers it
OURS_FIRST = """
    import json
    import populora_verl.trainer.trainer
    from populora_verl import plugin
    state = {"errors": dict(plugin._errors), "pending": sorted(plugin._pending)}
    plugin.check_registrations()
    state.update(registered=plugin.registered(), after_pending=sorted(plugin._pending))
    print(json.dumps(state))
"""


@pytest.fixture(scope="module")
def children() -> dict:
    """Every program of this module in an interpreter of its own (what ``import verl`` leaves out can only be seen in
    one): name -> the finished process (or what stopped it). The programs that begin with :data:`IMPORT_VERL` are
    forked one after another by a process that has run it (_shared.ForkServer: the child is where a fresh
    interpreter of the program would be after those lines); the two that must begin otherwise run fresh, beside
    them."""
    after_import_verl = {
        "import_verl_alone": IMPORT_VERL_ALONE,
        **{f"read:{case}": _registry_read(case) for case in REGISTRY_READS},
        "failing_register": FAILING_REGISTER,
    }
    fresh = SideBySide(
        {
            "registry_before_plugin": _job(REGISTRY_BEFORE_PLUGIN, VERL_USE_EXTERNAL_PLUGINS="none"),
            "ours_first": _job(OURS_FIRST),
        }
    )
    server = ForkServer(IMPORT_VERL, cwd=REPO, env=_job("")["env"])
    results: dict = {}
    try:
        for name, code in after_import_verl.items():
            job = _job(code)
            code = job["args"][-1]
            assert code.startswith(IMPORT_VERL), name
            try:
                if server.serves(code, job["env"]):
                    results[name] = server.start(code, job["env"]).result(timeout=300)
                else:
                    results[name] = subprocess.run(**job, capture_output=True, text=True, timeout=300)
            except Exception as e:  # reported by the test that reads it
                results[name] = e
        results.update(fresh.results())
    finally:
        server.close()
        fresh.close()
    return results


@pytest.fixture(scope="module")
def import_verl_alone(children) -> dict:
    return _state(children["import_verl_alone"])


def test_import_verl_imports_no_registry_module(import_verl_alone):
    state = import_verl_alone
    assert state["loaded"], "the plugin was not loaded by its entry point"
    assert state["imported"] == [], state["imported"]
    assert len(state["pending"]) == 5 and len(state["watched"]) == 5 and state["finder"], state


def test_the_finder_leaves_sys_meta_path_once_every_registration_ran(import_verl_alone):
    state = import_verl_alone
    assert state["after_pending"] == [] and state["after_watched"] == {} and not state["after_finder"], state
    assert state["errors"] == {} and all(state["registered"].values()), state


@pytest.mark.parametrize("case", list(REGISTRY_READS))
def test_importing_a_registry_module_registers_our_entry(case, children):
    state = _state(children[f"read:{case}"])
    assert state["errors"] == {} and state["imported"] == [], state
    what = {"trainer_base": "trainer", "rollout_base": "rollout"}.get(case, case)
    assert not any(k.startswith(what + ":") for k in state["pending"]), state


def test_a_registry_module_imported_before_the_plugin_is_registered_at_once(children):
    state = _state(children["registry_before_plugin"])
    assert state["in"] and state["errors"] == {}, state
    assert "adv_estimator:populora_trrpp" not in state["pending"] and len(state["pending"]) == 4, state


def test_a_failing_register_is_reported_in_one_line(children):
    out = finished(children["failing_register"])
    assert out.returncode == 0, out.stderr[-4000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["errors"] == {"adv_estimator:populora_trrpp": "ValueError: no estimator today"}, state
    message = state["message"]
    assert message and "\n" not in message and "adv_estimator:populora_trrpp" in message, message
    assert "no estimator today" in message and "trainer:populora" not in message, message
    warnings = [line for line in out.stderr.splitlines() if "registering adv_estimator 'populora_trrpp' failed" in line]
    assert len(warnings) >= 1, out.stderr[-3000:]


def test_our_module_imported_first_waits_quietly_and_registers_at_the_check(children):
    out = finished(children["ours_first"])
    assert out.returncode == 0, out.stderr[-4000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["errors"] == {} and "trainer:populora" in state["pending"], state
    assert all(state["registered"].values()) and state["after_pending"] == [], state
    assert "populora plugin: registering" not in out.stderr, out.stderr[-3000:]


# --- the hook on a package of its own (no verl) ---------------------------------------------------------------------


@pytest.fixture
def tmp_pkg(tmp_path, monkeypatch):
    """A package ``hookpkg_<n>`` (unique per test) on ``sys.path``; ``make(files)`` writes it, returns its name."""
    counter = {"n": 0}
    names: list[str] = []

    def make(files: dict[str, str]) -> str:
        counter["n"] += 1
        name = f"hookpkg_{os.getpid()}_{id(tmp_path)}_{counter['n']}"
        for rel, text in files.items():
            path = tmp_path / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        names.append(name)
        importlib.invalidate_caches()
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for mod in [m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names)]:
        del sys.modules[mod]
    sys.meta_path[:] = [
        f for f in sys.meta_path if not (isinstance(f, AfterImportFinder) and f is not import_hooks._FINDER)
    ]


def test_the_callback_runs_after_the_module_executed_and_the_finder_leaves(tmp_pkg):
    name = tmp_pkg({"__init__.py": "FIRST = 1\nLAST = 2\n"})
    finder = AfterImportFinder()
    seen: list[tuple] = []
    finder.add(name, lambda m: seen.append((m.__name__, getattr(m, "LAST", None), sys.modules.get(name) is m)))
    assert sys.meta_path[0] is finder and not seen
    mod = importlib.import_module(name)
    assert seen == [(name, 2, True)]
    assert finder not in sys.meta_path and finder.waiting() == {}
    assert type(mod.__loader__).__name__ == "SourceFileLoader" and mod.__spec__.loader is mod.__loader__


def test_a_package_fires_after_its_init_even_when_a_submodule_is_imported_first(tmp_pkg):
    name = tmp_pkg(
        {
            "__init__.py": "from .registry import REG\nfrom . import extra\n",
            "registry.py": "REG = {}\n",
            "extra.py": "X = 1\n",
        }
    )
    finder = AfterImportFinder()
    seen: list[bool] = []
    finder.add(name, lambda m: seen.append(hasattr(m, "extra") and "REG" in vars(m)))
    importlib.import_module(f"{name}.registry")  # the package's __init__ runs first, and whole
    assert seen == [True] and finder not in sys.meta_path


def test_an_imported_module_gets_its_callback_at_once(tmp_pkg):
    name = tmp_pkg({"__init__.py": "X = 1\n"})
    importlib.import_module(name)
    seen: list[str] = []
    import_hooks.after_import(name, lambda m: seen.append(m.__name__))
    assert seen == [name] and name not in import_hooks.pending()


def test_a_failing_callback_never_fails_the_import(tmp_pkg, caplog):
    name = tmp_pkg({"__init__.py": "X = 1\n"})
    seen: list[str] = []

    def broken(_module):
        raise KeyError("boom")

    import_hooks.after_import(name, broken)
    import_hooks.after_import(name, lambda m: seen.append(m.__name__))  # the next callback still runs
    with caplog.at_level(logging.WARNING, logger="populora_verl.import_hooks"):
        mod = importlib.import_module(name)
    assert mod.X == 1 and seen == [name] and name not in import_hooks.pending()
    assert any("boom" in r.getMessage() and name in r.getMessage() for r in caplog.records), caplog.text


def test_a_module_whose_import_fails_keeps_its_callbacks_for_the_next_import(tmp_pkg, tmp_path):
    name = tmp_pkg({"__init__.py": "raise RuntimeError('not yet')\n"})
    finder = AfterImportFinder()
    seen: list[str] = []
    finder.add(name, lambda m: seen.append(m.__name__))
    with pytest.raises(RuntimeError, match="not yet"):
        importlib.import_module(name)
    assert seen == [] and finder.waiting() == {name: 1} and finder in sys.meta_path
    (tmp_path / name / "__init__.py").write_text("X = 1\n")
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    importlib.import_module(name)
    assert seen == [name] and finder not in sys.meta_path


def test_a_module_half_way_through_its_import_waits_for_run_pending(tmp_pkg):
    name = tmp_pkg(
        {
            "__init__.py": (
                "from populora_verl import import_hooks\n"
                "SEEN = []\n"
                "import_hooks.after_import(__name__, lambda m: SEEN.append(m.DONE))\n"
                "DONE = True\n"
            )
        }
    )
    mod = importlib.import_module(name)
    assert mod.SEEN == [] and name in import_hooks.pending()  # its end could not be seen
    assert import_hooks.run_pending(name) and mod.SEEN == [True] and name not in import_hooks.pending()
    assert not import_hooks.run_pending(f"{name}_never_imported")
