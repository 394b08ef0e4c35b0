"""The documentation stays true to the code: every config key is documented, every README command parses,
every README link resolves, and CI runs exactly the README's test command."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _schema_keys(cls: type, prefix: str) -> list[str]:
    """Every dotted key of a config dataclass, sections expanded (``populora.pbt.interval_steps``, ...)."""
    keys = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        key = f"{prefix}.{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += _schema_keys(type(default), key)
        else:
            keys.append(key)
    return keys


def test_every_config_key_is_documented():
    from populora_verl.config import PopuLoRAConfig
    from populora_verl.local.config import LocalConfig

    page = (REPO / "docs" / "configuration.md").read_text()
    keys = _schema_keys(PopuLoRAConfig, "populora") + _schema_keys(LocalConfig, "local")
    assert len(keys) > 60  # the walk found the sections, not just their names
    missing = [k for k in keys if f"`{k}`" not in page]
    assert not missing, f"add a row to docs/configuration.md for: {missing}"


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _commands(text: str) -> list[str]:
    """Shell commands of the README: its ```bash blocks (continuation lines joined) and inline `python -m ...`."""
    cmds = []
    for block in _code_blocks(text, "bash"):
        cmds += [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    cmds += re.findall(r"`((?:python -m|populora-)[^`]*)`", text)
    return cmds


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find a module, without importing it (``import verl`` takes seconds)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    for base in spec.submodule_search_locations or []:
        p = Path(base, *rest)
        if p.with_suffix(".py").is_file() or (p / "__main__.py").is_file():
            return True
    return False


def test_readme_commands_parse():
    text = README.read_text()
    cmds = _commands(text)
    assert any("populora_verl.local" in c for c in cmds) and any("main_ppo" in c for c in cmds)
    scripts = re.findall(r'"(populora-[a-z]+) = ', (REPO / "setup.py").read_text())
    for cmd in cmds:
        r = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert r.returncode == 0, f"README command does not parse: {cmd}\n{r.stderr}"
        words = shlex.split(cmd.split("#")[0].replace("{", "").replace("}", ""))
        for i, w in enumerate(words):
            if w == "-m" and i > 0 and words[i - 1].endswith("python"):
                assert _module_exists(words[i + 1]), f"README runs a module that does not exist: {cmd}"
            if w.startswith("populora-"):
                assert w in scripts, f"README uses {w}, which setup.py does not install (has {scripts})"


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith("http")]
    assert "docs/configuration.md" in local
    for link in local:
        assert (REPO / link).exists(), f"README links to a missing file: {link}"


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_links_resolve(page: Path):
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # samples inside fences are not links
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", prose):
        if not link.startswith("http"):
            assert (page.parent / link).exists(), f"{page.name} links to a missing file: {link}"


def test_ci_runs_the_readme_test_command():
    blocks = [b.strip() for b in _code_blocks(README.read_text(), "bash")]
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci = (REPO / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), "the README's test command must be the one .ci/run runs"
