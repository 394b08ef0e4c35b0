"""The package's modules import each other without a circle.

The graph is read from the source (every ``import`` statement, also inside functions: a lazy import is still a
dependency), with what Python runs on an import: importing ``a.b.c`` first runs ``a/__init__`` and ``a/b/__init__``.
Two kinds of statements are not edges: imports under ``if TYPE_CHECKING:`` (never run), and a package
``__init__``'s imports of its own submodules inside functions (a lazy export, e.g. PEP 562 ``__getattr__``: it runs
when a user asks for the name, never when a sibling module is imported).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from _shared import REPO, finished, run_side_by_side

PACKAGE = REPO / "populora_verl"


def _name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _statements(tree: ast.AST, in_function: bool = False):
    """(import statement, inside a function?) for every import not guarded by ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (item for child in node.orelse for item in _statements(child, in_function))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        yield from _statements(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = {_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_init = path.name == "__init__.py"
        package = module if is_init else module.rpartition(".")[0]
        for node, in_function in _statements(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in (t for t in targets if t in files):
                if is_init and in_function and target.startswith(module + "."):
                    continue  # a lazy export of the package's own submodule
                parts = target.split(".")
                for k in range(1, len(parts) + 1):
                    step = ".".join(parts[:k])
                    # the importer's own packages have already run their __init__
                    if step in files and step != module and not module.startswith(step + "."):
                        graph[module].add(step)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles (each a set of modules that reach each other):\n" + "\n".join(map(str, found))


def test_the_checker_sees_a_lazy_circle_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "populora_verl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from populora_verl.sub import b\n")  # lazy, still an edge
    (pkg / "sub" / "__init__.py").write_text("from populora_verl.sub.b import x\n")
    (pkg / "sub" / "b.py").write_text("import populora_verl.a\nx = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from populora_verl import a\n")
    graph = import_graph(pkg)
    assert circles(graph) == [["populora_verl.a", "populora_verl.sub", "populora_verl.sub.b"]]
    assert graph["populora_verl.c"] == set()  # TYPE_CHECKING: not an edge


_PARTS = ["generation", "training", "hooks", "probes", "convert", "schedule", "timeline"]

#: Programs that import our modules before verl, each in a fresh interpreter (what ``import verl`` then does with
#: the plugin depends on what the interpreter imported first).
_BEFORE_VERL = {
    "trainer_parts": ("".join(f"import populora_verl.trainer.{p}\n" for p in _PARTS)
                      + "import verl\nfrom populora_verl.plugin import _errors, registered\n"
                      + "assert not _errors and all(registered().values()), (_errors, registered())\n"),
    "reward_manager": ("import populora_verl.reward.manager\nimport verl\n"
                       "from populora_verl.plugin import _errors, check_registrations, registered\n"
                       "assert 'reward_manager:populora_code' in _errors\n"  # the half-loaded module, as described
                       "check_registrations()\nassert not _errors and all(registered().values())\n"),
}


@pytest.fixture(scope="module")
def before_verl():
    """Each program of :data:`_BEFORE_VERL` in its own interpreter, side by side: name -> the finished process."""
    return run_side_by_side({name: {"args": [sys.executable, "-c", code]} for name, code in _BEFORE_VERL.items()})


def test_the_trainers_parts_import_before_verl_without_breaking_the_plugin(before_verl):
    """verl's import loads the plugin, which registers the trainer: a part of the trainer imported before verl must
    not import verl at its own import, or the registration meets it half-loaded and the trainer goes missing."""
    proc = finished(before_verl["trainer_parts"])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_registering_module_imported_before_verl_is_registered_at_the_check(before_verl):
    """The reward manager imports verl, whose import loads the plugin, which registers the half-loaded manager and
    fails: the start-up check tries again once the import has finished, and every registration is there."""
    proc = finished(before_verl["reward_manager"])
    assert proc.returncode == 0, proc.stderr[-3000:]
