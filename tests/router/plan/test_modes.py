"""The pd plan (router/plan/modes.py): one fresh bootstrap room in both bodies, and the bodies
spliced into the client's bytes decode as the parsed body would. Pure: no sockets."""

from __future__ import annotations

import pytest

from router.plan.modes import Call, PDPlanner
from tests.support.router_workers import pools, worker

pytestmark = pytest.mark.unit


async def test_pd_plan_puts_one_fresh_room_in_both_bodies():
    import msgspec

    prefills, decodes = pools([worker("http://p:1", "prefill")], [worker("http://d:1", "decode")])
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "bootstrap_room": 5}
    plan = await PDPlanner(prefills, decodes).plan(Call(body, True, None, 0.0), ())
    d, p = msgspec.json.decode(plan.answer.body), msgspec.json.decode(plan.sides[0].body)
    assert (plan.answer.stage, plan.sides[0].stage, plan.partner) == ("decode", "prefill", plan.sides[0])
    assert d["bootstrap_room"] == p["bootstrap_room"] == plan.room != 5 and 0 <= plan.room < 2**63
    assert (d["bootstrap_host"], d["bootstrap_port"], d["stream"], d["stream_options"]) == \
        ("127.0.0.1", 9000, True, {"include_usage": True})
    assert p["stream"] is False and "stream_options" not in p
    assert (await PDPlanner(prefills, decodes).plan(Call(body, True, None, 0.0), ())).room != plan.room


@pytest.mark.parametrize("raw", [
    b'{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream": false}  \n',
    b'{"messages":[{"role":"user","content":"}"}]}', b'{}', b' { } ',
    b'{"messages":[],"bootstrap_room":5,"bootstrap_host":"x"}',
])
async def test_pd_bodies_spliced_into_the_clients_bytes_decode_as_the_parsed_body_would(raw):
    import msgspec

    from router.plan.modes import pd_bodies

    body = msgspec.json.decode(raw)
    call = Call(body, body.get("stream") is True, None, 0.0, raw=raw)
    d, p = pd_bodies(call, "10.0.0.1", 9000, 7)
    fields = {k: v for k, v in body.items() if not k.startswith("bootstrap_")} | {
        "bootstrap_host": "10.0.0.1", "bootstrap_port": 9000, "bootstrap_room": 7}
    assert msgspec.json.decode(d) == fields
    assert msgspec.json.decode(p) == {k: v for k, v in fields.items() if k != "stream_options"} | {"stream": False}
    for sent in (d, p):  # never a duplicate key
        assert sent.count(b'"bootstrap_room"') == 1 and sent.count(b'"stream"') <= 1
    if body.get("stream") is False and "stream_options" not in body and "bootstrap_room" not in body:
        assert d is p  # one body for both
