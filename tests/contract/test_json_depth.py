"""The JSON-depth rule (``contract.json_depth``), the one algorithm the router and every stage run on a
body's bytes: arrays and objects count, brackets in strings do not, 64 levels pass. Pure."""

from __future__ import annotations

import pytest

from contract.json_depth import MAX_JSON_DEPTH, TOO_DEEP, too_deep

pytestmark = pytest.mark.unit


def nested(levels: int) -> str:
    """``levels`` levels of arrays and objects, alternating, around a number."""
    text = "1"
    for level in range(levels):
        text = f"[{text}]" if level % 2 else f'{{"k":{text}}}'
    return text


def test_the_bound_is_64_levels_and_the_message_names_it():
    assert MAX_JSON_DEPTH == 64
    assert TOO_DEEP == "The request body is nested deeper than 64 levels of JSON arrays and objects."


def test_the_bound_counts_arrays_and_objects_outside_strings():
    assert not too_deep(nested(64).encode()) and too_deep(nested(65).encode())
    assert not too_deep(b'{"text": "' + b"[{" * 5000 + b'"}')  # text, not nesting
    assert not too_deep(b'{"a": "\\"[[[", "b": ' + nested(63).encode() + b"}")  # an escaped quote ends no string
    assert too_deep(b'{"a": "\\\\", "b": ' + nested(64).encode() + b"}")  # an escaped backslash does
    assert not too_deep(b"[" + b"[]," * 100_000 + b"[]]")  # many arrays, two levels


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_bodies_are_too_deep_wherever_the_nesting_is(depth):
    for template in (b'{"messages":NEST}', b'{"messages":[{"role":"user","content":"hi"}],"extra":NEST}',
                     b'{"a": {"b": [1, {}, {}, {"c": NEST}]}}'):
        assert too_deep(template.replace(b"NEST", b"[" * depth + b"]" * depth))


@pytest.mark.parametrize("raw, limit, deep", [
    (b"", 0, False), (b"1", 0, False), (b"[]", 0, True), (b"[]", 1, False), (b"[[]]", 1, True),
    (b"[[[", 2, True),  # unclosed: judged by its brackets as written (the parser reports the rest)
    (b"]]][[[", 0, False),  # closers first: the depth runs below zero and climbs back to it
    (b"]]][[[[", 0, True),
    (b'"[[[[" []', 1, False),  # a string, then one level
    (b'"unterminated [[[[', 1, True),  # no closing quote: no string, brackets count
    (b"[" * (1 << 21) + b"]" * (1 << 21), 1 << 21, False),  # across numpy's chunks: depth carried over
    (b"[" * ((1 << 21) + 1), 1 << 21, True),
])
def test_edges(raw, limit, deep):
    assert too_deep(raw, limit) is deep
