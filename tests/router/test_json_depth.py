"""The router's JSON depth limit (router/app.py's body parse): a body nested deeper than 64
levels of arrays and objects is a 400 invalid_json, 64 levels pass whole. Pure: no sockets."""

from __future__ import annotations

import pytest

from router.app import _parse
from router.errors import RouterError

pytestmark = pytest.mark.unit


def test_json_nested_deeper_than_64_levels_is_refused():
    message = "The request body is nested deeper than 64 levels of JSON arrays and objects."

    def nested(depth: int, field: str = "messages") -> bytes:  # the body itself is level 1
        return ('{"%s":' % field + "[" * (depth - 1) + "]" * (depth - 1) + "}").encode()

    inner = _parse(nested(64))["messages"]  # 64 levels pass whole
    for _ in range(62):
        inner = inner[0]
    assert inner == []
    for raw in (nested(65), nested(65, "metadata"), nested(1000), nested(100_000),
                b'{"a": {"b": [1, ' + b"{}, " * 3 + b'{"c": ' + b"[" * 70 + b"]" * 70 + b"}]}}"):
        with pytest.raises(RouterError) as error:
            _parse(raw)
        assert (error.value.status, error.value.body()) == (400, {"error": {
            "message": message, "type": "invalid_request_error", "param": None, "code": "invalid_json"}})
