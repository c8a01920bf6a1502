"""Small interfaces: no function of the product packages takes more than ``MAX_PARAMETERS`` parameters
(``self`` and ``cls`` aside; ``*args`` and ``**kwargs`` count one each), read statically with ``ast``
as ``tests/support/import_graph.py`` reads imports. A factory that needs more takes a config object
(``stages.api.app_config.AppConfig``, ``stages.engine.prefilled.Prefilled``); a dataclass's generated
constructor is not read, its fields are its interface.

The exceptions are deliberate, each with its reason. The list may only shrink: an exception whose
function is gone or back within the limit fails too, so that it is taken off.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.import_graph import module_names

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("cli", "contract", "process", "stages", "transfer", "cache", "router", "telemetry")
MAX_PARAMETERS = 6
EXCEPTIONS = {  # "module:qualified name" -> why it takes more
    "stages.engine.paged_decode:_decode_kernel": "a Triton kernel: its pointers, strides and tile sizes are its "
                                                 "arguments, and a kernel takes no objects",
    "stages.engine.attention:paged_attention": "Hugging Face's attention interface: the model calls it with "
                                               "these arguments",
    "router.http.request:Request.__init__": "a record of the parsed request line and headers, one parameter a "
                                            "slot, built in one place on the router's hot path",
    "transfer.bootstrap_server:BootstrapServer.__init__": "the fingerprint it checks and where it binds, then four "
                                                          "keyword-only limits with defaults, set one at a time",
    "stages.modelgen:make_model": "the generator's entry (stage make-model's flags): what, how big, where, the seed, "
                                  "then three keyword-only choices with defaults (LLaVA's towers, the hub layout)",
    "stages.disagg.errors:DisaggError.__init__": "the OpenAI four, then what the answer adds (image_key, peer_code, "
                                                 "Retry-After); rooms raise it through its kinds (bad_gateway, ...)",
}


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Its parameters' names, ``self``/``cls`` aside (pure)."""
    args = function.args
    names = [a.arg for a in [*args.posonlyargs, *args.args]]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    names += [a.arg for a in args.kwonlyargs]
    names += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None]
    return names


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of ``tree`` (nested ones too), with its qualified name (pure)."""
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                stack.append((child, f"{prefix}{child.name}.<locals>."))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{prefix}{child.name}."))
            else:
                stack.append((child, prefix))


def over_the_limit() -> dict[str, list[str]]:
    """``module:qualified name`` -> parameters, for each product function over ``MAX_PARAMETERS``."""
    found = {}
    for module, path in module_names(REPO, PRODUCT).items():
        for name, function in functions(ast.parse(path.read_text(), str(path))):
            if len(names := parameters(function)) > MAX_PARAMETERS:
                found[f"{module}:{name}"] = names
    return found


def test_no_product_function_takes_more_than_the_limit():
    found = over_the_limit()
    broken = [f"{name}({', '.join(names)})" for name, names in sorted(found.items()) if name not in EXCEPTIONS]
    assert not broken, f"over {MAX_PARAMETERS} parameters (take a config object):\n" + "\n".join(broken)


def test_the_exceptions_only_shrink():
    stale = sorted(set(EXCEPTIONS) - set(over_the_limit()))
    assert not stale, "no longer over the limit (or gone): take them off EXCEPTIONS:\n" + "\n".join(stale)


def test_the_reader_counts_what_a_caller_passes():
    """Negative control: the reader sees methods, nested functions, keyword-only and star parameters."""
    tree = ast.parse("class A:\n"
                     "    def m(self, a, /, b, *c, d, **e): pass\n"
                     "    @classmethod\n"
                     "    def k(cls, a): pass\n"
                     "def f():\n"
                     "    async def g(a, b=1): pass\n")
    assert {name: parameters(function) for name, function in functions(tree)} == {
        "A.m": ["a", "b", "d", "*c", "*e"], "A.k": ["a"], "f": [], "f.<locals>.g": ["a", "b"]}
