"""The verl.plugins entry point registers PopuLoRA's parts at `import verl`, in a fresh interpreter."""

import json
import os
import subprocess
import sys


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("populora") == "populora_verl.plugin"


def test_import_verl_alone_registers_everything():
    code = (
        "import json, verl\n"
        "import populora_verl.plugin as p\n"
        "print(json.dumps(p.registered()))\n"
        "p.check_registrations()\n"
        "import sys; print(json.dumps(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))))\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto", RAY_AUTH_MODE="disabled")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if l.startswith(("{", "["))]
    registered = json.loads(lines[0])
    assert registered and all(registered.values()), registered
    assert json.loads(lines[1]) == [], "the plugin must not import vLLM"


def test_check_registrations_reports_missing(monkeypatch):
    import populora_verl.plugin as p

    monkeypatch.setattr(p, "EXPECTED", p.EXPECTED + [("adv_estimator", "no_such_estimator")])
    try:
        p.check_registrations()
    except RuntimeError as e:
        assert "no_such_estimator" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("missing registration not reported")
