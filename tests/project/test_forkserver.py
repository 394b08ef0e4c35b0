"""The tests' fork server (tests/_forkserver.py, _shared.ForkServer): a program it forks sees what a fresh
``python -c`` of the same program would see, and ends the same way. The modules that use it (tests/patches,
tests/project/test_lazy_registration.py) rest on this: their checks are about what an interpreter imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _shared import ForkServer

PRELUDE = textwrap.dedent("""
    import json, os, sys
    import email.message  # a package that a bare interpreter has not imported
    print("from the prelude")
    print("the prelude, on stderr", file=sys.stderr)
    seen_in_prelude = sorted(sys.modules)
""")

STATE = PRELUDE + textwrap.dedent("""
    import random
    main = sys.modules["__main__"]
    print(json.dumps({
        "modules": sorted(sys.modules),
        "seen_in_prelude": seen_in_prelude,
        "path": sys.path,
        "path_importer_cache": sorted(sys.path_importer_cache),
        "meta_path": [type(f).__name__ for f in sys.meta_path],
        "argv": sys.argv,
        "main": sorted(vars(main)),
        "main_file": getattr(main, "__file__", None),
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "current_test": os.environ.get("PYTEST_CURRENT_TEST"),
        "flags": list(sys.flags),
        "dont_write_bytecode": sys.dont_write_bytecode,
        "stdout_tty": sys.stdout.isatty(),
        "stdout_line_buffering": sys.stdout.line_buffering,
        "warnings": sys.warnoptions,
        "threads": __import__("threading").active_count(),
    }))
""")

#: name -> program after the prelude: how a program ends
ENDINGS = {
    "raises": "x = 1\nraise ValueError(f'boom {x}')\n",
    "raises_chained": "try:\n    {}['k']\nexcept KeyError as e:\n    raise RuntimeError('again') from e\n",
    "exits_3": "sys.exit(3)\n",
    "exits_with_a_message": "sys.exit('bye')\n",
    "exits_none": "print('done'); raise SystemExit\n",
    "atexit": "import atexit\natexit.register(print, 'at exit')\nprint('main')\n",
    "thread": "import threading\nt = threading.Thread(target=print, args=('from a thread',))\nt.start()\n",
    "unflushed": "sys.stdout.write('no newline, never flushed')\n",
    "killed": "import signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
}


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "POPULORA_FORKSERVER_TEST": str(tmp_path)}


def _fresh(code: str, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def server(tmp_path):
    server = ForkServer(PRELUDE, cwd=tmp_path, env=_env(tmp_path))
    yield server
    server.close()


def _forked(server: ForkServer, code: str, env) -> subprocess.CompletedProcess:
    assert server.serves(code, env), server.why_not
    return server.start(code, env).result(timeout=120)


def test_a_forked_program_sees_what_a_fresh_interpreter_sees(server, tmp_path):
    env = _env(tmp_path)
    fresh, forked = _fresh(STATE, tmp_path, env), _forked(server, STATE, env)
    assert fresh.returncode == 0 and forked.returncode == 0, fresh.stderr + forked.stderr
    assert forked.args == fresh.args
    assert forked.stdout.splitlines()[0] == fresh.stdout.splitlines()[0] == "from the prelude"
    assert forked.stderr == fresh.stderr == "the prelude, on stderr\n"
    a, b = (json.loads(r.stdout.splitlines()[-1]) for r in (fresh, forked))
    assert "email.message" in a["seen_in_prelude"] and "_forkserver" not in b["modules"]
    assert a["threads"] == b["threads"] == 1
    assert a["current_test"] == b["current_test"] and a["current_test"]  # the test that runs now
    assert a == b


def test_a_forked_program_ends_as_a_fresh_one(server, tmp_path):
    env = _env(tmp_path)
    for name, rest in ENDINGS.items():
        code = PRELUDE + rest
        fresh, forked = _fresh(code, tmp_path, env), _forked(server, code, env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), name
    assert fresh.returncode == -9  # the last one: killed, as subprocess reports it
    by_name = {name: _forked(server, PRELUDE + rest, env) for name, rest in ENDINGS.items()}
    assert "line 8, in <module>\nValueError: boom 1" in by_name["raises"].stderr  # the program's own line
    assert by_name["exits_3"].returncode == 3 and by_name["exits_with_a_message"].stderr.endswith("bye\n")
    assert by_name["atexit"].stdout.endswith("main\nat exit\n")


def test_each_forked_program_starts_from_the_prelude_s_state(server, tmp_path):
    """What one program changes (a module global, the environment, a module it imports) the next does not see."""
    env = _env(tmp_path)
    first = _forked(server, PRELUDE + "import csv\nos.environ['LEFT'] = '1'\njson.dumps = None\n", env)
    assert first.returncode == 0, first.stderr
    second = _forked(
        server, PRELUDE + "assert 'csv' not in sys.modules and 'LEFT' not in os.environ\nprint(json.dumps([1]))\n", env
    )
    assert second.returncode == 0 and second.stdout.endswith("[1]\n"), second.stderr


def test_a_program_it_cannot_fork_faithfully_is_refused(server, tmp_path):
    env = _env(tmp_path)
    assert not server.serves("import json\n", env)  # does not begin with the prelude
    assert not server.serves(PRELUDE, {**env, "OTHER": "1"})  # another environment
    assert server.serves(PRELUDE, {**env, "PYTEST_CURRENT_TEST": "another test"})
    running = server.start(PRELUDE, env)
    assert not server.serves(PRELUDE, env)  # busy
    running.result(timeout=120)
    assert server.serves(PRELUDE, env)


@pytest.mark.parametrize(
    "prelude,why",
    [
        (
            "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n",
            "2 Python threads",
        ),
        ("raise ImportError('no such thing')\n", "ImportError: no such thing"),
    ],
)
def test_a_prelude_that_leaves_a_thread_or_fails_serves_no_one(tmp_path, prelude, why):
    server = ForkServer(prelude, cwd=tmp_path, env=_env(tmp_path))
    try:
        assert not server.serves(prelude + "print(1)\n", _env(tmp_path))
        assert why in server.why_not, server.why_not
    finally:
        server.close()
    assert server.proc.returncode == 0


def test_a_program_past_its_timeout_is_stopped_with_the_server(server, tmp_path):
    env, code = _env(tmp_path), PRELUDE + "import threading\nthreading.Event().wait()\n"
    assert server.serves(code, env), server.why_not
    running = server.start(code, env)
    with pytest.raises(subprocess.TimeoutExpired):
        running.result(timeout=1)  # the program never ends
    assert server.proc.returncode == -9 and not server.serves(PRELUDE, env) and server.why_not == "stopped"


def test_close_ends_the_server_and_removes_its_files(tmp_path):
    server = ForkServer(PRELUDE, cwd=tmp_path, env=_env(tmp_path))
    assert server.serves(PRELUDE, _env(tmp_path)), server.why_not
    assert server.start(PRELUDE, _env(tmp_path)).result(timeout=120).returncode == 0
    files = server._dir
    assert files.is_dir()
    server.close()
    assert server.proc.returncode == 0 and not files.exists()  # it left its loop when told to
