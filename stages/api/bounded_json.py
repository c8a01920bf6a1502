"""Reading a request body's JSON at a cost bounded by its size, shared by the chat and completions
first passes (``stages.api.parse``, ``stages.api.completion_schema``).

msgspec builds a whole array or map before it checks its length, so a body of millions of tiny
entries costs seconds and gigabytes before the 400. Fields whose entries can be many (``logit_bias``,
``metadata``, a completion's list of token-id lists) are kept as raw JSON and their entries counted
here on the bytes first; msgspec's validation messages become 400s naming the field.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from contract.errors import Code
from stages.api.errors import APIError, bad_request
from stages.api.json_depth import check_json_depth

S = TypeVar("S")

Scalar = str | int | float | bool | None
MSGSPEC_ERROR = re.compile(r"(?P<what>.*) - at `\$\.?(?P<path>.*)`", re.S)
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[][{},]')  # a string (its commas are text), a bracket, a comma


def decode_shape(raw: bytes | bytearray, shape: type[S]) -> S:
    """The body decoded into ``shape`` (a msgspec Struct whose every list is bounded): 400 if it nests
    deeper than ``MAX_JSON_DEPTH`` (before any parser recurses), is not JSON, or breaks a bound."""
    check_json_depth(raw)
    try:
        return msgspec.json.decode(raw, type=shape)
    except msgspec.ValidationError as exc:
        raise shape_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", param=None, code=Code.INVALID_JSON) from None


def shape_error(message: str, prefix: str = "") -> APIError:
    """msgspec's ``Expected `array` of length <= 2048 - at `$.messages``` -> 400 naming ``messages``
    (``prefix``: the field the decoded value sits in, e.g. ``prompt``)."""
    match = MSGSPEC_ERROR.fullmatch(message)
    what, path = (match["what"], match["path"]) if match else (message, "")
    param = prefix + path if prefix or path else None
    where = f"Invalid value for '{param}': " if param else "Invalid request body: "
    return bad_request(where + what, param=param, code=Code.INVALID_VALUE)


def more_items(raw: memoryview, bound: int) -> bool:
    """Whether ``raw`` (valid JSON, an array or an object) has more than ``bound`` items: its commas
    outside strings at depth 1, read up to the one that makes ``bound + 1`` items."""
    depth = commas = 0
    for token in _JSON_TOKEN.finditer(raw):
        char = token[0][:1]
        if char in (b"{", b"["):
            depth += 1
        elif char in (b"}", b"]"):
            depth -= 1
        elif char == b"," and depth == 1:
            commas += 1
            if commas >= bound:
                return True
    return False


def check_map(raw: bytes | memoryview, name: str, bound: int) -> None:
    """400 naming ``name`` if ``raw`` is an object of more than ``bound`` entries (counted without
    building it) or not a map of scalars (a scalar passes: the schema's validation names it)."""
    view = memoryview(raw)
    if view[:1] == b"{" and more_items(view, bound):
        raise bad_request(f"Invalid value for '{name}': Expected `object` of length <= {bound}", name, Code.INVALID_VALUE)
    try:
        msgspec.json.decode(view, type=dict[str, Scalar] | Scalar)
    except msgspec.ValidationError as exc:
        match = MSGSPEC_ERROR.fullmatch(str(exc))
        raise bad_request(f"Invalid value for '{name}': {match['what'] if match else exc}", name,
                          Code.INVALID_VALUE) from None
