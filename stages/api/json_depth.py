"""A stage's answer to a body nested too deep: 400 ``invalid_json``, as the router's (the rule and its
one algorithm: ``contract.json_depth``). Checked on the raw bytes before any parser recurses."""

from __future__ import annotations

from contract.errors import Code
from contract.json_depth import TOO_DEEP, too_deep
from stages.api.errors import bad_request


def check_json_depth(raw: bytes | bytearray) -> None:
    """APIError 400 ``invalid_json`` if ``raw`` nests deeper than ``contract.json_depth.MAX_JSON_DEPTH``."""
    if too_deep(raw):
        raise bad_request(TOO_DEEP, param=None, code=Code.INVALID_JSON)
