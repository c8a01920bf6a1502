"""The bootstrap fields (``contract.bootstrap``): the router writes them into both bodies of a pd request,
the stages' request models take them with the contract's room bound."""

from __future__ import annotations

import msgspec
import pytest

from contract.bootstrap import BOOTSTRAP_FIELDS, ROOM_MAX
from contract.paths import CHAT_PATH
from router.plan.modes import Call, pd_bodies
from stages.api.completion_schema import CompletionRequest
from stages.api.schemas import ChatCompletionRequest

pytestmark = pytest.mark.unit


def test_the_fields_and_the_room_bound():
    assert BOOTSTRAP_FIELDS == ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert ROOM_MAX == 2**63 - 1


def test_the_router_replaces_any_the_client_sent():
    body = {"messages": [{"role": "user", "content": "hi"}], "bootstrap_room": {}, "bootstrap_host": "evil"}
    decode, prefill = pd_bodies(Call(body, False, None, 0.0, path=CHAT_PATH), "10.0.0.1", 8998, ROOM_MAX)
    for raw in (decode, prefill):
        sent = msgspec.json.decode(raw)
        assert [sent[name] for name in BOOTSTRAP_FIELDS] == ["10.0.0.1", 8998, ROOM_MAX]


def test_the_stages_request_models_take_the_fields():
    for model in (ChatCompletionRequest, CompletionRequest):
        fields = model.model_json_schema()["properties"]
        assert set(BOOTSTRAP_FIELDS) <= set(fields), model
        room = fields["bootstrap_room"]["anyOf"][0]
        assert (room["minimum"], room["maximum"]) == (0, ROOM_MAX), model


def test_the_router_drops_a_clients_bootstrap_fields_in_every_mode():
    """The router's read of a body (``router.app``): a client's bootstrap fields are dropped before any
    plan (colocated too), and the client's bytes no longer stand for the body."""
    from router.app import _without_router_fields

    raw = b'{"messages":[],"bootstrap_room":{},"bootstrap_port":"x"}'
    body, sent = _without_router_fields(msgspec.json.decode(raw), raw)
    assert (body, sent) == ({"messages": []}, None)
    plain = b'{"messages":[]}'
    assert _without_router_fields(msgspec.json.decode(plain), plain) == ({"messages": []}, plain)
