"""Static complexity of task programs: AST depth, cyclomatic complexity and lines of code.

Programs come from teacher models and are hostile input: they are only *parsed* (``ast`` and radon, which itself
works on the AST and the token stream), never compiled to bytecode or executed. A program that does not parse, or
that is pathological enough to exhaust the parser (deep nesting, huge size), yields ``None`` instead of an error.

Definitions (the paper names the three measures but not how it computes them; these are ours):

* ``ast_depth``: the number of nodes on the longest root-to-leaf path of the AST, the ``Module`` root counted as 1.
  Context and operator nodes (``Load``/``Store``, ``Add``, ``And``, ``Eq``, ...) are tokens rather than structure,
  so they are not counted: ``x = 1`` has depth 3 (Module > Assign > Name/Constant).
* ``cyclomatic``: McCabe's cyclomatic number of the whole program, i.e. the **sum** of radon's ``cc_visit``
  complexity over every routine (functions, methods and nested functions), plus decision points at module level.
  McCabe's V(G) = E - N + 2P of a program of P routines is exactly this sum, so a helper function adds its own
  branching; ``max`` over blocks would hide that. A program with no routine counts its module body as one.
* ``loc``: radon's ``sloc``: lines that are neither blank, comments nor docstrings.
* ``ast_nodes``: the number of structural AST nodes (same exclusions as ``ast_depth``); an extra descriptor.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

__all__ = [
    "DESCRIPTORS",
    "ProgramComplexity",
    "ast_depth",
    "ast_node_count",
    "cyclomatic_complexity",
    "source_loc",
    "program_complexity",
    "complexities",
]

logger = logging.getLogger(__name__)

# Every descriptor a ProgramComplexity carries, in a stable order.
DESCRIPTORS: tuple[str, ...] = ("ast_depth", "cyclomatic", "loc", "ast_nodes")

# Leaf "token" node classes: every occurrence of e.g. ``Load`` adds one level under a Name, which measures
# nothing about the program's structure.
_TOKEN_NODES = (ast.expr_context, ast.operator, ast.boolop, ast.unaryop, ast.cmpop)

# Parsing hostile text can fail in more ways than SyntaxError: NUL bytes (ValueError), parser recursion limits
# (RecursionError, MemoryError), absurd literals (OverflowError).
_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError, TypeError)


@dataclass(frozen=True)
class ProgramComplexity:
    """Complexity measures of one program (see the module docstring for definitions)."""

    ast_depth: int
    cyclomatic: int
    loc: int
    ast_nodes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def get(self, descriptor: str) -> float:
        if descriptor not in DESCRIPTORS:
            raise ValueError(f"unknown complexity descriptor {descriptor!r} (known: {list(DESCRIPTORS)})")
        return float(getattr(self, descriptor))


def _structural_children(node: ast.AST) -> list[ast.AST]:
    return [c for c in ast.iter_child_nodes(node) if not isinstance(c, _TOKEN_NODES)]


def ast_depth(tree: ast.AST) -> int:
    """Nodes on the longest root-to-leaf path (root = 1). Iterative: hostile ASTs can be thousands deep."""
    deepest = 0
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in _structural_children(node))
    return deepest


def ast_node_count(tree: ast.AST) -> int:
    """Structural nodes in the tree (token nodes excluded), counted iteratively."""
    count = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(_structural_children(node))
    return count


def _routine_complexities(blocks: Iterable) -> Iterable[int]:
    """radon's per-routine complexities, with nested functions and classes included exactly once.

    ``cc_visit`` lists top-level functions, classes and their methods; it neither adds a closure's complexity to
    its parent (a known radon limitation) nor lists closures or inner classes' methods as blocks, so we walk them here.
    A ``Class`` block's own complexity is the sum of its methods and is skipped to avoid counting them twice.
    """
    from radon.visitors import Class, Function

    stack = list(blocks)
    seen: set[tuple[int, int, str]] = set()
    while stack:
        block = stack.pop()
        if isinstance(block, Class):
            # cc_visit lists methods both inside the class and as top-level blocks; ``seen`` dedupes them.
            stack.extend(block.methods)
            stack.extend(block.inner_classes)
        elif isinstance(block, Function):
            key = (block.lineno, block.col_offset, block.name)
            if key in seen:
                continue
            seen.add(key)
            yield int(block.complexity)
            stack.extend(block.closures)


def cyclomatic_complexity(tree: ast.Module) -> int:
    """Sum of radon cyclomatic complexity over all routines, plus module-level decision points."""
    from radon.complexity import cc_visit_ast
    from radon.visitors import ComplexityVisitor

    routines = list(_routine_complexities(cc_visit_ast(tree)))
    # The module visitor starts at 1 and counts only decisions outside functions and classes.
    module_decisions = ComplexityVisitor.from_ast(tree).complexity - 1
    if not routines:
        return 1 + module_decisions
    return sum(routines) + module_decisions


def source_loc(source: str) -> int:
    """radon's ``sloc``: non-blank lines that are not comments or docstrings."""
    from radon.raw import analyze

    return int(analyze(source).sloc)


def program_complexity(source: str, *, max_chars: int | None = None) -> ProgramComplexity | None:
    """Complexity of one program's source text, or ``None`` if it does not parse (never raises for bad input).

    ``max_chars`` skips (returns ``None`` for) programs longer than that many characters, before any parsing.
    """
    if not isinstance(source, str):
        return None
    if max_chars is not None and len(source) > max_chars:
        return None
    try:
        tree = ast.parse(source, mode="exec")
    except _PARSE_ERRORS:
        return None
    try:
        cyclomatic = cyclomatic_complexity(tree)
        loc = source_loc(source)
    except (RecursionError, MemoryError):
        # radon's visitors recurse over the AST; a program such as ``1+1+...+1`` (thousands of terms) parses but
        # is deeper than the interpreter's recursion limit. Such a program is not a meaningful task anyway.
        return None
    except Exception as e:  # noqa: BLE001 - radon on adversarial text: anything it raises means "skip"
        logger.debug("radon failed on a program that parsed (%s: %s); skipping it", type(e).__name__, e)
        return None
    return ProgramComplexity(ast_depth=ast_depth(tree), cyclomatic=cyclomatic, loc=loc, ast_nodes=ast_node_count(tree))


def complexities(programs: Sequence[str], *, max_chars: int | None = None) -> tuple[list[ProgramComplexity], int]:
    """Complexities of the programs that parse, and the number skipped because they did not."""
    out: list[ProgramComplexity] = []
    skipped = 0
    for program in programs:
        c = program_complexity(program, max_chars=max_chars)
        if c is None:
            skipped += 1
        else:
            out.append(c)
    return out, skipped
