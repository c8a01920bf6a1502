"""The import graph of ``stages``, ``transfer``, ``cache``, ``router`` and ``bench`` (read statically,
``tests/import_graph.py``) has no circle of modules, and every import goes the one way the design
card says (docs/architecture.md):

    stages -> transfer, cache        router -> cache        transfer, cache -> nothing of ours
    bench -> stages (the launching package, the engine), transfer, cache
    the CLI (``stages.cli``) -> anything; nothing imports the CLI but the CLI itself

Circles are looked for among *all* imports: module level, ``if TYPE_CHECKING:`` and function-level
(lazy) ones alike. A lazy import still ties the two modules together (it only defers the failure to
the first call), and the circle the CLI and ``bench`` used to form ran through lazy imports.

``KNOWN_CIRCLE_EDGES`` are the edges whose removal breaks the circles that are still there, each with
the issue item that removes it: it may only shrink (an edge no longer in the graph fails the test
until it is deleted from the list).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import Edge, circles, find_circle, graph, imports_of

REPO = Path(__file__).resolve().parents[1]
CLI = "stages.cli"
MAY_IMPORT = {  # package -> the other packages its modules may import (the CLI aside)
    "stages": {"transfer", "cache"},
    "router": {"cache"},
    "transfer": set(),
    "cache": set(),
    "bench": {"stages", "transfer", "cache"},
}
KNOWN_CIRCLE_EDGES: dict[tuple[str, str], str] = {}  # (importer, imported): why it is still there


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return graph(REPO)


def in_cli(module: str) -> bool:
    return module == CLI or module.startswith(CLI + ".")


def refusal(edge: Edge) -> str | None:
    """Which direction rule ``edge`` breaks, or None (pure)."""
    if in_cli(edge.source):
        return None  # the roof
    if in_cli(edge.target):
        return "nothing imports the CLI"
    source, target = edge.source.split(".")[0], edge.target.split(".")[0]
    if source != target and target not in MAY_IMPORT[source]:
        return f"{source} imports nothing of {target}"
    return None


def describe(circle: list[str], edges: list[Edge]) -> str:
    lines = {(e.source, e.target): e for e in edges}
    return "\n".join(f"  {lines[pair]}" for pair in zip(circle, circle[1:]))


def test_no_circle_of_modules(edges):
    pairs = {(e.source, e.target) for e in edges} - set(KNOWN_CIRCLE_EDGES)
    found = circles(pairs)
    assert not found, "import circles:\n" + "\n\n".join(describe(circle, edges) for circle in found)


def test_the_known_circles_only_shrink(edges):
    pairs = {(e.source, e.target) for e in edges}
    gone = [edge for edge in KNOWN_CIRCLE_EDGES if edge not in pairs]
    assert not gone, f"no longer imported, delete from KNOWN_CIRCLE_EDGES: {gone}"
    for edge in KNOWN_CIRCLE_EDGES:  # each still closes a circle, or it is not needed on the list
        assert find_circle(pairs - (set(KNOWN_CIRCLE_EDGES) - {edge})) is not None, f"{edge} closes no circle"


def test_imports_go_one_way(edges):
    broken = [f"{edge}: {why}" for edge in edges if (why := refusal(edge)) is not None]
    assert not broken, "\n".join(broken)


def test_the_cli_imports_bench_and_the_router_and_is_imported_by_no_one(edges):
    """The roof exists and is a roof: it adds ``stage bench`` and ``stage serve router``; the tests that
    exercise the CLI import it, but no module of the five packages does."""
    assert {("stages.cli", "bench.cli"), ("stages.cli.router", "router.cli")} <= {(e.source, e.target) for e in edges}
    assert not [e for e in edges if in_cli(e.target) and not in_cli(e.source)]


# --- the checker itself ----------------------------------------------------------------------
def test_a_circle_is_found_and_named():
    assert find_circle([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) in (
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert find_circle([("a", "b"), ("b", "c"), ("a", "c")]) is None
    found = circles([("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"), ("a", "c")])
    assert sorted(sorted(set(circle)) for circle in found) == [["a", "b"], ["c", "d"]]


def test_every_kind_of_import_is_an_edge():
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d", "other"}
    source = "\n".join([
        "from __future__ import annotations",
        "import os",  # not ours: no edge
        "import other",
        "from typing import TYPE_CHECKING",
        "from . import c",  # relative: a module of this package
        "from ..b import name",  # relative to the parent package, a name in a module
        "if TYPE_CHECKING:",
        "    import pkg.a",
        "def f():",
        "    from pkg.sub.c import name",  # lazy
        "    import pkg.nothing",  # no such module: the package it names
    ])
    found = {(e.target, e.lazy) for e in imports_of("pkg.sub.d", source, False, modules)}
    assert found == {("other", False), ("pkg.sub.c", False), ("pkg.b", False), ("pkg.a", False),
                     ("pkg.sub.c", True), ("pkg", True)}
    in_package = {e.target for e in imports_of("pkg", "from . import a\nfrom .sub import c", True, modules)}
    assert in_package == {"pkg.a", "pkg.sub.c"}


def test_a_broken_rule_is_named():
    assert refusal(Edge("bench.common.args", "stages.cli", 9, False)) == "nothing imports the CLI"
    assert refusal(Edge("stages.server", "router.listen", 16, False)) == "stages imports nothing of router"
    assert refusal(Edge("router.server_info", "stages.launch.instance", 3, True)) == "router imports nothing of stages"
    assert refusal(Edge("cache.embedded", "stages.launch.processes", 1, True)) == "cache imports nothing of stages"
    assert refusal(Edge("stages.cli", "bench.cli", 1, False)) is None
    assert refusal(Edge("bench.compare.session", "stages.launch.stack", 1, False)) is None


def test_the_admin_token_variable_is_the_same_on_both_sides():
    """The router and the stages read the admin token from one environment variable; each names it
    itself, since neither may import the other."""
    from router.cli import TOKEN_ENV as ROUTER_TOKEN_ENV
    from stages.config import TOKEN_ENV as STAGE_TOKEN_ENV

    assert ROUTER_TOKEN_ENV == STAGE_TOKEN_ENV == "EPD_ADMIN_TOKEN"
