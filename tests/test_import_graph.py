"""The import graph of the product packages and ``bench`` (read statically, ``tests/support/import_graph.py``)
has no circle of modules, and every import goes down the floors of docs/architecture.md, with no
exemption:

    cli (the roof)  -> anything; nothing imports it
    bench           -> stages, router, transfer, cache, contract, process, telemetry
    router          -> cache, contract, process, telemetry
    stages          -> transfer, cache, contract, process, telemetry
    transfer, cache -> contract, process, telemetry      contract, process, telemetry -> nothing of ours

(``telemetry``, tracing, is a leaf like ``contract`` and ``process``: every package above may import it.)

Circles are looked for among *all* imports: module level, ``if TYPE_CHECKING:`` and function-level
(lazy) ones alike. A lazy import still ties the two modules together (it only defers the failure to
the first call).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_graph import Edge, circles, find_circle, graph, imports_of

REPO = Path(__file__).resolve().parents[1]
CLI = "cli"
LEAVES = {"contract", "process", "telemetry"}  # torch-free: what the router and the stages agree on, how a process
# starts, and tracing (OpenTelemetry, imported only when on)
MAY_IMPORT = {  # package -> the other packages its modules may import; the CLI may import anything
    "bench": {"stages", "router", "transfer", "cache", *LEAVES},  # router: bench.fleet_scale times its planner in process
    "router": {"cache", *LEAVES},
    "stages": {"transfer", "cache", *LEAVES},
    "transfer": LEAVES,
    "cache": LEAVES,
    "contract": set(),
    "process": set(),
    "telemetry": set(),
}


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
    pairs = {(e.source, e.target) for e in edges}
    found = circles(pairs)
    assert not found, "import circles:\n" + "\n\n".join(describe(circle, edges) for circle in found)


@pytest.mark.unit
def test_imports_go_one_way(edges):
    broken = [f"{edge}: {why}" for edge in edges if (why := refusal(edge)) is not None]
    assert not broken, "\n".join(broken)


@pytest.mark.unit
def test_the_cli_imports_bench_and_the_router_and_is_imported_by_no_one(edges):
    """The roof exists and is a roof: it adds ``stage bench`` and ``stage serve router``; the tests that
    exercise the CLI import it, but no product or bench module does."""
    assert {("cli", "bench.cli"), ("cli", "cli.router"), ("cli.router", "router.config")} <= {
        (e.source, e.target) for e in edges}
    assert not [e for e in edges if in_cli(e.target) and not in_cli(e.source)]


# --- the checker itself ----------------------------------------------------------------------
@pytest.mark.unit
def test_a_circle_is_found_and_named():
    assert find_circle([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) in (
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert find_circle([("a", "b"), ("b", "c"), ("a", "c")]) is None
    found = circles([("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"), ("a", "c")])
    assert sorted(sorted(set(circle)) for circle in found) == [["a", "b"], ["c", "d"]]


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_broken_rule_is_named():
    assert refusal(Edge("bench.common.args", "cli", 9, False)) == "nothing imports the CLI"
    assert refusal(Edge("stages.server", "router.listen", 16, False)) == "stages imports nothing of router"
    assert refusal(Edge("router.server_info", "stages.launch.health", 3, True)) == "router imports nothing of stages"
    assert refusal(Edge("cache.embedded", "stages.launch.stack", 1, True)) == "cache imports nothing of stages"
    assert refusal(Edge("contract.errors", "cache.keys", 1, False)) == "contract imports nothing of cache"
    assert refusal(Edge("router.fleet.discovery", "process.instance", 1, False)) is None
    assert refusal(Edge("cli", "bench.cli", 1, False)) is None
    assert refusal(Edge("bench.compare.session", "stages.launch.stack", 1, False)) is None
    assert refusal(Edge("telemetry.otel", "contract.errors", 1, False)) == "telemetry imports nothing of contract"
    assert refusal(Edge("router.app", "telemetry.tracing", 1, False)) is None
    assert refusal(Edge("stages.server", "telemetry", 1, True)) is None


@pytest.mark.unit
def test_the_leaf_packages_are_read(edges):
    """``telemetry`` is not among ``tests.support.import_graph``'s default packages: its edges are read too."""
    assert ("telemetry.tracing", "telemetry.otel", True) in {(e.source, e.target, e.lazy) for e in edges}
