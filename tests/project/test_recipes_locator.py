"""The recipes are found from a checkout and from an installed package: ``populora_verl.recipes.recipes_dir()``
and ``python -m populora_verl.recipes``, and setup.py's package data puts every recipe into the wheel."""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from populora_verl import recipes

from _shared import REPO

CHECKOUT = REPO / "recipes" / "populora"
YAMLS = sorted(p.relative_to(CHECKOUT).as_posix() for p in CHECKOUT.rglob("*.yaml"))


def _run_module(cwd: Path, pythonpath: Path | None = None, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:  # ahead of the checkout's editable install
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-m", "populora_verl.recipes", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def _installed_layout(site: Path, with_recipes: bool = True) -> Path:
    """``site/populora_verl`` as a wheel installs it: the locator module, and the recipes under ``_recipes``."""
    pkg = site / "populora_verl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    shutil.copy(Path(recipes.__file__), pkg / "recipes.py")
    if with_recipes:
        shutil.copytree(CHECKOUT, pkg / recipes.INSTALLED / recipes.FAMILY)
    return pkg


def test_the_checkout_has_recipes():
    assert len(YAMLS) >= 10 and "2t2s.yaml" in YAMLS and "prompts/envelope_last.yaml" in YAMLS


def test_recipes_dir_finds_the_checkout():
    d = recipes.recipes_dir()
    assert d == CHECKOUT and d.is_absolute()
    assert recipes.checkout_recipes(REPO / "populora_verl") == CHECKOUT
    from populora_verl.bench import learning_run, step_scaling

    assert learning_run.RECIPES == step_scaling.RECIPES == CHECKOUT


def test_cli_prints_the_checkout_folder(tmp_path):
    r = _run_module(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{CHECKOUT}\n"
    assert _run_module(tmp_path, None, "--help").returncode == 0
    bad = _run_module(tmp_path, None, "2t2s")
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_installed_branch_finds_the_package_copy(tmp_path, monkeypatch):
    pkg = _installed_layout(tmp_path / "site")
    (tmp_path / "work").mkdir()
    r = _run_module(tmp_path / "work", tmp_path / "site")
    assert r.returncode == 0, r.stderr
    found = Path(r.stdout.strip())
    assert found == pkg / "_recipes" / "populora" and r.stdout == f"{found}\n"
    assert sorted(p.relative_to(found).as_posix() for p in found.rglob("*.yaml")) == YAMLS
    # the same branch in-process, under another package name (so the real populora_verl stays imported)
    shutil.copytree(pkg, tmp_path / "other" / "fake_populora")
    monkeypatch.syspath_prepend(str(tmp_path / "other"))
    assert recipes.installed_recipes("fake_populora") == tmp_path / "other" / "fake_populora" / "_recipes" / "populora"
    assert recipes.checkout_recipes(tmp_path / "other" / "fake_populora") is None  # not a checkout
    assert recipes.installed_recipes("no_such_package_populora") is None


def test_no_recipes_anywhere_is_one_clear_error(tmp_path):
    _installed_layout(tmp_path / "site", with_recipes=False)
    r = _run_module(tmp_path, tmp_path / "site")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("populora: no recipes:") and "--config-path" in r.stderr


_SETUP_KWARGS = """
import json, runpy, setuptools
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
runpy.run_path("setup.py", run_name="__main__")
print(json.dumps({k: seen.get(k) for k in ("packages", "package_dir", "package_data")}))
"""


def _setup_kwargs() -> dict:
    """What setup.py passes to setuptools.setup (setup.py run with setup() replaced; in a fresh interpreter, since
    setuptools must be imported before anything loads the standard library's distutils)."""
    r = subprocess.run([sys.executable, "-c", _SETUP_KWARGS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _package_data_files(kw: dict, package: str) -> dict[str, list[str]]:
    """Pattern -> matched files of one package, globbed as setuptools' build_py does (recursive ``**``)."""
    src = REPO / (kw.get("package_dir") or {}).get(package, package.replace(".", "/"))
    return {pat: sorted(os.path.relpath(f, src).replace(os.sep, "/")
                        for f in glob.glob(os.path.join(src, pat), recursive=True) if os.path.isfile(f))
            for pat in kw["package_data"][package]}


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="reading setup.py needs setuptools")
def test_setup_package_data_covers_every_recipe():
    kw = _setup_kwargs()
    name = f"{recipes.PACKAGE}.{recipes.INSTALLED}"  # where recipes_dir() looks in an installed package
    assert name in kw["packages"] and kw["package_dir"][name] == "recipes"
    shipped = {f for files in _package_data_files(kw, name).values() for f in files}
    assert sorted(f.removeprefix(recipes.FAMILY + "/") for f in shipped if f.startswith(recipes.FAMILY + "/")) == YAMLS
    # and no pattern of any package is dead (the old populora_verl "recipes/*.yaml" matched nothing)
    for package in kw["package_data"]:
        dead = [pat for pat, files in _package_data_files(kw, package).items() if not files]
        assert not dead, f"setup.py package_data of {package}: {dead} match no file"


def _can_build_wheels_here() -> bool:
    """pip, and a setuptools that builds wheels without build isolation (70.1 on, or any with the wheel package)."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        return False
    m = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("setuptools"))
    return (m is not None and (int(m[1]), int(m[2])) >= (70, 1)) or importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels_here(), reason="building the wheel offline needs pip and setuptools>=70.1")
def test_the_wheel_carries_the_recipes(tmp_path):
    """The wheel (built from a copy of the tree, a few seconds) holds every recipe, and the unpacked wheel's
    ``python -m populora_verl.recipes`` prints its own copy."""
    src = tmp_path / "src"
    src.mkdir()
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "populora_verl", src / "populora_verl", ignore=ignore)
    shutil.copytree(REPO / "recipes", src / "recipes", ignore=ignore)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("populora_verl-*.whl")
    prefix = f"populora_verl/{recipes.INSTALLED}/{recipes.FAMILY}/"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert sorted(n.removeprefix(prefix) for n in names if n.startswith(prefix)) == YAMLS
    assert not [n for n in names if n.startswith("recipes/")]  # no top-level recipes package in site-packages
    (tmp_path / "work").mkdir()
    out = _run_module(tmp_path / "work", tmp_path / "site")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{tmp_path / 'site' / 'populora_verl' / '_recipes' / 'populora'}\n"
