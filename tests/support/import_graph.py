"""The static import graph of the product packages and ``bench`` (read with ``ast``, nothing imported).

An edge ``a -> b`` means module ``a``'s source imports module ``b``: ``import b``, ``from b import
name`` (to ``b.name`` when that is a module of ours, else to ``b``), relative imports resolved against
``a``'s package. Only our own modules are nodes; an edge goes to the most specific module named (a
package's ``__init__`` is a node of its own, reached only when it is named).

Each edge is *eager* or *lazy*: eager when the import runs when ``a`` is imported (module level,
including inside ``if``/``try`` blocks and ``if TYPE_CHECKING:``, which a type checker follows like
any other import), lazy when it sits inside a function body (it runs when the function is called).
Circles are looked for among eager edges; the direction rules hold for both kinds.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("cli", "contract", "process", "stages", "transfer", "cache", "router", "bench", "telemetry")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}{', lazy' if self.lazy else ''})"


def module_names(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> source file (``pkg/__init__.py`` is ``pkg``).
    Folders whose names are no identifiers (``.venv-tools``, ``__pycache__``'s kin) hold no module of ours."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if not all(part.isidentifier() for part in parts[:-1]):
                continue
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, source: str, is_package: bool, modules: set[str]) -> list[Edge]:
    """The edges from module ``name`` (whose text is ``source``) to ``modules`` (pure)."""
    package = name if is_package else name.rpartition(".")[0]
    edges = []
    for node, lazy in _import_nodes(ast.parse(source)):
        for target in _targets(node, package, modules):
            if target != name:
                edges.append(Edge(name, target, node.lineno, lazy))
    return edges


def _import_nodes(tree: ast.Module) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it is inside a function (lazy)."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        inside = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inside) for child in ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [m for alias in node.names if (m := _ours(alias.name, modules))]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            found.append(f"{base}.{alias.name}")
        elif (m := _ours(base, modules)) is not None:
            found.append(m)
    return sorted(set(found))


def _ours(dotted: str, modules: set[str]) -> str | None:
    """The most specific module of ours that ``dotted`` names (``a.b.c`` -> ``a.b`` if only that exists)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def graph(root: Path, packages: Iterable[str] = PACKAGES) -> list[Edge]:
    """Every import edge among the modules of ``packages`` under ``root``."""
    files = module_names(root, packages)
    names = set(files)
    return [edge for name, path in files.items()
            for edge in imports_of(name, path.read_text(), path.name == "__init__.py", names)]


def find_circle(edges: Iterable[tuple[str, str]]) -> list[str] | None:
    """One circle of the directed graph ``edges`` as its modules (the first again at the end), or None (pure)."""
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for source, target in edges:
        sorter.add(source, target)
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        return list(reversed(exc.args[1]))
    return None


def circles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Circles of ``edges``, one at a time: find one, drop its edges, look again, until none is left.
    Every module on a circle appears in at least one of them (pure)."""
    remaining = set(edges)
    found = []
    while (circle := find_circle(remaining)) is not None:
        found.append(circle)
        remaining -= set(zip(circle, circle[1:]))
    return found
