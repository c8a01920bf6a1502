"""The nesting bound of a JSON request body, checked on the raw bytes before any parser recurses. Pure.

A JSON parser recurses once per level of arrays and objects: ~1000 levels exhaust Python's recursion
limit (msgspec raises RecursionError while skipping an unknown field). No request of this API nests
deeper than a few levels, so the router and every stage refuse a body nested deeper than
``MAX_JSON_DEPTH`` with the same 400 ``invalid_json`` (message ``TOO_DEEP``), wherever the nesting is
(a known field, an unknown one). Brackets inside strings are text and do not count.

The check is linear and bounded in memory: a body with at most ``MAX_JSON_DEPTH`` openers (the usual
one) passes on two ``bytes.count`` calls; else strings are cut out (one copy at most the body's
size), the rest is reduced to its brackets and their running depth is summed in fixed-size numpy
chunks (about 20 ns a byte; no parser, no recursion, no Python loop per bracket).
"""

from __future__ import annotations

import re
from typing import Final

import numpy as np

MAX_JSON_DEPTH: Final = 64
TOO_DEEP: Final = f"The request body is nested deeper than {MAX_JSON_DEPTH} levels of JSON arrays and objects."
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_CHUNK = 1 << 20


def too_deep(raw: bytes | bytearray, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``raw`` nests arrays and objects more than ``limit`` levels deep (outside strings).
    Malformed JSON is judged by its brackets as written; the parser reports the rest."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the usual body: too few openers to be that deep
        return False
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    depth = 0
    for start in range(0, len(brackets), _CHUNK):
        running = np.cumsum(_STEP[brackets[start:start + _CHUNK]], dtype=np.int64) + depth
        if running.max() > limit:
            return True
        depth = int(running[-1])
    return False
