"""The nesting bound of a JSON request body, checked on the raw bytes before any parser recurses.

A JSON parser recurses once per level of arrays and objects: ~1000 levels exhaust Python's recursion
limit (msgspec raises RecursionError while skipping an unknown field). No request of this API nests
deeper than a few levels, so every stage refuses a body nested deeper than ``MAX_JSON_DEPTH`` with
the same 400 as the router, wherever the nesting is (a known field, an unknown one). Brackets
inside strings are text and do not count.

The check is linear and bounded in memory: strings are cut out (one copy at most the body's size,
short for a text body), the rest is reduced to its brackets and their running depth is summed in
fixed-size numpy chunks.
"""

from __future__ import annotations

import re

import numpy as np

from stages.api.errors import APIError, bad_request

MAX_JSON_DEPTH = 64
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


def check_json_depth(raw: bytes | bytearray) -> None:
    """APIError 400 ``invalid_json`` if ``raw`` nests deeper than ``MAX_JSON_DEPTH``."""
    if too_deep(raw):
        raise too_deep_error()


def too_deep_error() -> APIError:
    return bad_request(f"The request body is nested deeper than {MAX_JSON_DEPTH} levels of JSON arrays and objects.",
                       param=None, code="invalid_json")
