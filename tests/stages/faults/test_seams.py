"""No product function names a fault point: the points live in ``stages/faults/`` and reach the
production code only through its seams (hooks that do nothing by default, a wrapped transfer
backend, a wrapped ``generate``, an HTTP middleware). Read with ``ast``, nothing imported; a
negative control shows the check catches the calls it forbids."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stages.faults.points import POINTS
from tests.support.import_graph import PACKAGES, module_names

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]
FAULTS = Path("stages/faults")
EXITS = {  # where os._exit is the only way out
    Path("process/children.py"),  # a forked child whose parent died before exec
    Path("stages/envcheck/ucx_probe.py"),  # stage env's UCX probe child: UCX's library destructors crash a normal exit
}
TABLE = "stages.faults.points"  # the armed points; the rest of the product asks ``stages.faults.seams`` only


def violations(source: str) -> list[tuple[int, str]]:
    """(line, what) for each thing in ``source`` only the fault package may do: name a fault point
    (``faults.take("prefill.crash")``), import the table of armed points, call ``os._exit``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in POINTS:
            found.append((node.lineno, f"names fault point {node.value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr == "_exit" and _is_name(node.value, "os"):
            found.append((node.lineno, "calls os._exit"))
        elif isinstance(node, ast.Import) and any(alias.name == TABLE for alias in node.names):
            found.append((node.lineno, f"imports {TABLE}"))
        elif isinstance(node, ast.ImportFrom) and _imports_table_or_exit(node):
            found.append((node.lineno, f"imports {TABLE} or os._exit"))
    return sorted(found)


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _imports_table_or_exit(node: ast.ImportFrom) -> bool:
    names = {alias.name for alias in node.names}
    return (node.module == TABLE or (node.module == "stages.faults" and "points" in names)
            or (node.module == "os" and "_exit" in names))


def product_sources() -> dict[Path, str]:
    return {path.relative_to(REPO): path.read_text() for path in module_names(REPO, PACKAGES).values()}


def test_no_product_code_outside_the_fault_package_names_a_fault_point_or_exits():
    broken = [f"{path}:{line}: {what}" for path, source in product_sources().items()
              if not path.is_relative_to(FAULTS)
              for line, what in violations(source) if not (path in EXITS and what == "calls os._exit")]
    assert not broken, "\n".join(broken)


@pytest.mark.unit
def test_every_fault_point_is_taken_by_a_seam():
    """Each documented point is named by a seam module of the fault package (none is dead)."""
    seams = [source for path, source in product_sources().items()
             if path.is_relative_to(FAULTS) and path.name not in ("points.py", "__init__.py")]
    named = {node.value for source in seams for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert set(POINTS) <= named, sorted(set(POINTS) - named)


@pytest.mark.unit
def test_the_check_catches_the_old_fault_calls():
    """Negative control: the fault calls as they once sat in the prefill, the decode and the encoder."""
    old = '''
import os
from os import _exit
from stages.faults import points
from stages.faults.points import EXIT_CODE, Faults

def run(self, room):
    if self.faults.take("prefill.exit_before_forward"):
        os._exit(EXIT_CODE)
'''
    assert [what for _, what in violations(old)] == [
        f"imports {TABLE} or os._exit", f"imports {TABLE} or os._exit", f"imports {TABLE} or os._exit",
        "names fault point 'prefill.exit_before_forward'", "calls os._exit"]
    assert violations('"""Mentions ``prefill.crash`` in prose."""\nlog = "prefill.crash: done"') == []
