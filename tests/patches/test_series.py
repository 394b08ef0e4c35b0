"""The patches of patches/ apply to the installed verl one after another, in order, without fuzz, and every module
they touch still parses (each patch on its own: tests/project/test_verl_signatures.py)."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from _shared import REPO

VERL = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
PATCHES = REPO / "patches"


@pytest.mark.skipif(shutil.which("patch") is None, reason="`patch` not installed")
def test_series_applies_in_order(tmp_path):
    shutil.copytree(VERL, tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    touched = set()
    for name in sorted(p.name for p in PATCHES.glob("*.patch")):
        res = subprocess.run(["patch", "-p1", "--forward", "-i", str(PATCHES / name)], cwd=tmp_path,
                             capture_output=True, text=True)
        assert res.returncode == 0 and "fuzz" not in res.stdout.lower(), f"{name} after its predecessors:\n{res.stdout}"
        touched |= set(re.findall(r"^\+\+\+ b/(\S+)", (PATCHES / name).read_text(), re.M))
    for rel in sorted(touched):
        text = (tmp_path / rel).read_text()
        if rel.endswith(".py"):
            ast.parse(text)
        else:
            assert rel.endswith(".yaml"), rel
            yaml.safe_load(text)
