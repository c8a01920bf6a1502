"""The router's pure parts: config validation, SSE splitting and reading, failure verdicts, image
URL checks, worker pairing and picking, the stream tally. No sockets."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from router.app import _parse
from router.fleet.breaker import CircuitBreaker
from router.config import RouterConfig
from router.dispatch.dispatcher import Dispatcher
from router.errors import RouterError, stage_failed
from router.plan.images import check_remote, image_parts
from router.metrics import Metrics
from router.plan.modes import Call, PDPlanner, Plan, Target
from router.plan.policy import RoundRobin
from router.dispatch.sse import DONE_EVENT, Kind, SSESplitter, classify, error_event, text_choice
from router.dispatch.tally import Tally
from router.dispatch.timeline import RoomLog
from router.dispatch.verdict import blame, from_answer, from_event, timed_out, unreachable
from router.fleet.workers import Pool, Worker, fingerprint_diff, lease_all, pairing_report, pick_pair

P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


# --- config ----------------------------------------------------------------------------------
def test_mode_follows_from_the_roles():
    assert RouterConfig(colocated=("http://h:1",)).mode == "colocated"
    assert RouterConfig(prefill=(P,), decode=(D,)).mode == "pd"
    assert RouterConfig(prefill=(P,), decode=(D,), encoder=("http://h:3",), redis_url="redis://h:6379").mode == "epd"


@pytest.mark.parametrize("kwargs, message", [
    ({}, "no workers: give --colocated URL, or --prefill URL and --decode URL"),
    ({"prefill": (P,)}, "pd mode needs both --prefill and --decode workers; --decode is missing"),
    ({"decode": (D,)}, "pd mode needs both --prefill and --decode workers; --prefill is missing"),
    ({"colocated": ("http://h:1",), "decode": (D,)}, "--colocated cannot be mixed with --prefill, --decode or --encoder"),
    ({"prefill": (P,), "decode": (D,), "encoder": ("http://h:3",)}, "epd mode (--encoder given) needs --redis-url"),
    ({"colocated": ("h:1",)}, "--colocated takes http://host:port URLs, got 'h:1'"),
    ({"colocated": ("http://h:1/v1",)}, "--colocated takes http://host:port URLs without a path"),
    ({"colocated": ("http://h",)}, "--colocated takes http://host:port URLs, got 'http://h'"),
    ({"prefill": ("http://h:99999",), "decode": (D,)}, "--prefill takes http://host:port URLs, got 'http://h:99999'"),
    ({"colocated": ("http://[::1:80",)}, "--colocated takes http://host:port URLs, got 'http://[::1:80'"),
    ({"colocated": ("http://h:1", "http://h:1")}, "--colocated names the same URL twice"),
    ({"colocated": ("http://h:1",), "policy_decode": "random"}, "--policy-decode must be one of"),
    ({"colocated": ("http://h:1",), "policy_colocated": "cache_aware"}, "--policy-colocated must be one of"),
    ({"colocated": ("http://h:1",), "max_body_mb": 0}, "--max-body-mb must be > 0, got 0"),
    ({"colocated": ("http://h:1",), "max_in_flight": 0}, "--max-in-flight must be > 0, got 0"),
    ({"colocated": ("http://h:1",), "upstream_timeout_s": -1}, "--upstream-timeout-s must be > 0, got -1"),
    ({"colocated": ("http://h:1",), "retries": -1}, "--retries must be >= 0, got -1"),
    ({"colocated": ("http://h:1",), "allowed_image_hosts": ("http://x/",)}, "--allowed-image-hosts takes host"),
])
def test_config_errors_name_the_flag(kwargs, message):
    with pytest.raises(ValueError) as error:
        RouterConfig(**kwargs)
    assert message in str(error.value)


def test_cache_aware_is_for_encoders():
    assert RouterConfig(prefill=(P,), decode=(D,), encoder=("http://h:3",), redis_url="redis://h",
                        policy_encoder="cache_aware").policy("encoder") == "cache_aware"


# --- SSE -------------------------------------------------------------------------------------
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TEXT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}\n\n'
ERROR = b'data: {"error":{"message":"boom","type":"server_error","param":null,"code":"engine_error"}}\n\n'
DONE = b"data: [DONE]\n\n"
TEXT_3 = b'data: {"id":"c","choices":[{"index":3,"delta":{"content":"b"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'


def test_splitter_returns_complete_events_and_keeps_the_rest():
    stream = ROLE + TEXT + DONE
    splitter = SSESplitter()
    out = []
    for i in range(0, len(stream), 7):  # any cut, including inside the blank line
        out += splitter.feed(stream[i:i + 7])
    assert out == [ROLE, TEXT, DONE] and splitter.pending == b""
    assert splitter.feed(b"data: [DO") == [] and splitter.pending == b"data: [DO"


def test_splitter_takes_crlf_boundaries():
    assert SSESplitter().feed(b"data: 1\r\n\r\ndata: 2\n\n") == [b"data: 1\r\n\r\n", b"data: 2\n\n"]


def test_splitter_cut_anywhere_gives_the_events_of_the_whole():
    """Whole events fed one by one (its fast path), and the same bytes cut at random points (some
    with CRLF, blank runs, a boundary split in two), give the events a split of the whole gives."""
    rng = random.Random(7)
    pieces = [b"data: %d\n\n" % i for i in range(40)] + [b"data: x\r\n\r\n", b": keep-alive\n\n", b"\n\n",
                                                          b"data: a\n\n\n", b"data: b\r\n\n"]
    rng.shuffle(pieces)
    whole = b"".join(pieces)
    expected, start = [], 0
    for match in re.finditer(rb"\r?\n\r?\n", whole):
        expected.append(whole[start:match.end()])
        start = match.end()
    for cuts in ([sum(map(len, pieces[:i])) for i in range(len(pieces) + 1)],
                 sorted({0, len(whole), *rng.sample(range(len(whole)), 60)})):
        splitter, out = SSESplitter(), []
        for a, b in zip(cuts, cuts[1:]):
            out += splitter.feed(whole[a:b])
        assert out == expected and splitter.pending == whole[start:]


@pytest.mark.parametrize("raw, kind, commits", [
    (ROLE, Kind.OPEN, True), (TEXT, Kind.TEXT, True), (FINISH, Kind.FINISH, True), (USAGE, Kind.USAGE, True),
    (ERROR, Kind.ERROR, False), (DONE, Kind.DONE, True), (b": keep-alive\n\n", Kind.COMMENT, False),
    (b"data: not json\n\n", Kind.OTHER, False),
])
def test_classify(raw, kind, commits):
    event = classify(raw)
    assert event.kind is kind and event.commits is commits and event.raw == raw


@pytest.mark.parametrize("raw", [
    ROLE, TEXT, FINISH, USAGE, ERROR, DONE, b": keep-alive\n\n", b"data: not json\n\n",
    b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"error"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\r\n\r\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"hi \\"delta\\":{\\"content\\":\\"x"}}]}\n\n',
    b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"hi"},"finish_reason":null}]}\n\n',
    TEXT_3, b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"choices":[{"index":-1,"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a","tool_calls":[{"index":0,"id":"c"}]}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[{"token":"a","logprob":-1.0}]}}]}\n\n',
])
def test_text_choice_is_sure_or_defers_to_classify(raw):
    """``text_choice`` names a choice only where ``classify`` says TEXT with that one output; anything it
    is unsure of it leaves to classify."""
    index = text_choice(raw)
    if index is not None:
        event = classify(raw)
        assert event.kind is Kind.TEXT and event.outputs == (index,)
    if raw in (TEXT, TEXT_3):
        assert index == (3 if raw == TEXT_3 else 0)


def test_error_event_is_one_event_and_done_ends_the_stream():
    assert error_event({"error": {"message": "m"}}) == b'data: {"error":{"message":"m"}}\n\n'
    assert classify(DONE_EVENT).kind is Kind.DONE


def test_tally_times_tokens_from_usage_or_text_chunks():
    tally = Tally(started=10.0)
    for raw, now in ((ROLE, 10.1), (TEXT, 10.5), (TEXT, 10.7), (TEXT, 10.9), (FINISH, 10.95)):
        tally.see(classify(raw), now)
    assert tally.ttft == pytest.approx(0.5) and tally.tpot == pytest.approx(0.2)
    tally.see(classify(USAGE), 11.0)  # 7 tokens in 3 chunks: the stage held text back
    assert tally.tpot == pytest.approx(0.4 / 6)
    tally.see(classify(DONE), 11.0)
    assert tally.done and tally.error is None
    assert Tally(started=0.0).ttft is None and Tally(started=0.0).tpot is None


# --- verdicts --------------------------------------------------------------------------------
def test_failures_from_answers_and_events():
    raw = b'{"error":{"message":"bad image","type":"invalid_request_error","param":"p","code":"invalid_image"}}'
    failure = from_answer("decode", D, 400, raw)
    assert (failure.message, failure.code, failure.raw, failure.client_fault) == ("bad image", "invalid_image", raw, True)
    assert from_answer("decode", D, 409, b'{"error":{"message":"m","code":"room_conflict"}}').client_fault is False
    assert from_answer("decode", D, 502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"
    event = from_event("decode", D, {"error": {"message": "lost the prefill", "code": "peer_failed"}})
    assert (event.status, event.code, event.client_fault) == (502, "peer_failed", False)
    assert from_event("decode", D, {"error": {"message": "m", "code": "room_timeout"}}).status == 504
    assert unreachable("decode", D, "ServerDisconnectedError").unreachable
    assert timed_out("decode", D, 5, "--upstream-timeout-s").message == \
        f"{D} did not answer within 5 s (--upstream-timeout-s)"


def test_a_busy_stage_is_back_pressure_not_a_fault():
    """A 503 with Retry-After is the stage at its limits: busy (no breaker charge, tried elsewhere,
    the client's 503 keeps the Retry-After); a 503 without it, or another status with it, is not."""
    raw = b'{"error":{"message":"at its limit","code":"server_overloaded"}}'
    busy = from_answer("prefill", P, 503, raw, "2")
    assert (busy.busy, busy.retry_after, busy.client_fault, busy.unreachable) == (True, "2", False, False)
    assert not from_answer("prefill", P, 503, b'{"error":{"message":"redis","code":"cache_unavailable"}}').busy
    assert not from_answer("prefill", P, 500, raw, "2").busy
    error = stage_failed("prefill", 503, busy.message, busy.code, busy.retry_after)
    assert (error.status, error.headers, error.code) == (503, {"Retry-After": "2"}, "server_overloaded")
    assert stage_failed("prefill", 503, "m", "engine_unavailable").headers == {"Retry-After": "1"}


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


def test_blame_goes_to_the_unfinished_partner_only_for_peer_errors():
    peer = from_event("decode", D, {"error": {"message": "partner never arrived within 3 s", "code": "peer_failed"}})
    blamed = blame(peer, ("prefill", P))
    assert (blamed.stage, blamed.url, blamed.code) == ("prefill", P, "peer_failed")
    assert blamed.message == "the decode stage reports: partner never arrived within 3 s"
    assert blame(peer, None) is peer  # the prefill answered fine: the decode is to blame
    own = from_event("decode", D, {"error": {"message": "engine died", "code": "engine_error"}})
    assert blame(own, ("prefill", P)) is own


def test_blame_moved_to_the_prefill_takes_its_code_and_image_from_the_decodes_fields():
    """The decode names its prefill's code (``peer_code``) and image (``image_key``): the prefill's
    failure has that code and image, the room kept; without ``peer_code`` the decode's code stays."""
    key = "ab" * 32
    raw = json.dumps({"error": {"message": "prefill failed room 9: x", "type": "server_error", "param": None,
                                         "code": "peer_failed", "stage": "decode", "room": 9, "image_key": key,
                                         "peer_code": "encode_failed"}}).encode()
    answer = from_answer("decode", D, 502, raw)
    assert (answer.code, answer.peer_code, answer.image_key, answer.room) == ("peer_failed", "encode_failed", key, 9)
    blamed = blame(answer, ("prefill", P))
    assert (blamed.stage, blamed.url, blamed.status, blamed.code, blamed.room, blamed.image_key, blamed.peer_code) == (
        "prefill", P, 502, "encode_failed", 9, key, None)
    assert blamed.message == "the decode stage reports: prefill failed room 9: x"
    assert blame(answer, None) is answer  # the prefill answered: the decode's own failure, fields as they came
    timeout = from_event("decode", D, {"error": {"message": "no KV", "code": "room_timeout", "room": 9,
                                                 "peer_code": "", "image_key": 5}})
    assert (timeout.peer_code, timeout.image_key) == (None, None)  # empty or wrongly typed: no field
    assert (blame(timeout, ("prefill", P)).code, blame(timeout, ("prefill", P)).image_key) == ("room_timeout", None)


# --- images ----------------------------------------------------------------------------------
def test_image_parts_in_order_with_their_params():
    body = {"messages": [
        {"role": "system", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}},
                                     {"type": "image_url", "image_url": "u2"}]},
        "not a message", {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]}
    parts = image_parts(body)
    assert [(p.url, p.param) for p in parts] == [("u1", "messages[1].content[1].image_url"),
                                                 ("u2", "messages[1].content[2].image_url")]
    parts[0].replace_url("data:x")
    parts[1].replace_url("data:y")
    assert body["messages"][1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:x"}}
    assert body["messages"][1]["content"][2] == {"type": "image_url", "image_url": "data:y"}
    assert image_parts({"messages": "nope"}) == []


@pytest.mark.parametrize("url, allowed", [
    ("http://img.example:8080/a.png", ("img.example:8080",)),
    ("https://IMG.example/a.png", ("img.example",)),
    ("https://img.example/a.png", ("img.example:443",)),
    ("http://[::1]:9000/a.png", ("[::1]:9000",)),
    ("http://127.0.0.1:9000/a.png", ("other", "127.0.0.1")),
])
def test_allowed_hosts(url, allowed):
    check_remote(url, allowed, "p")


@pytest.mark.parametrize("url, allowed, code", [
    ("http://img.example:8081/a.png", ("img.example:8080",), "image_host_not_allowed"),
    ("http://evil.example/a.png", ("img.example",), "image_host_not_allowed"),
    ("http://img.example.evil/a.png", ("img.example",), "image_host_not_allowed"),
    ("http://localhost:9000/a.png", ("127.0.0.1:9000",), "image_host_not_allowed"),
    ("http://a.png", (), "image_host_not_allowed"),
    ("ftp://img.example/a.png", ("img.example",), "invalid_image_url"),
    ("http://img.example:99999/a.png", ("img.example",), "invalid_image_url"),
])
def test_refused_hosts(url, allowed, code):
    with pytest.raises(RouterError) as error:
        check_remote(url, allowed, "messages[0].content[0].image_url")
    assert (error.value.status, error.value.code, error.value.param) == (400, code,
                                                                         "messages[0].content[0].image_url")


# --- workers and pairing ---------------------------------------------------------------------
FP = {"model": "qwen2_vl-abc", "backend": "mooncake", "dtype": "float32", "block_size": 16}


def worker(url: str, role: str, fingerprint: dict | None = FP, healthy: bool = True) -> Worker:
    w = Worker(url, role, CircuitBreaker(1, 10.0), healthy=healthy, models=("m",), fingerprint=fingerprint,
               bootstrap=("127.0.0.1", 9000) if role == "prefill" else None, known=True)
    return w


def pools(prefills: list[Worker], decodes: list[Worker]) -> tuple[Pool, Pool]:
    return Pool("prefill", prefills, RoundRobin()), Pool("decode", decodes, RoundRobin())


def test_incompatible_pairs_are_never_picked_and_reported():
    p16, p32 = worker("http://p:1", "prefill"), worker("http://p:2", "prefill", {**FP, "block_size": 32})
    d16 = worker("http://d:1", "decode")
    prefills, decodes = pools([p16, p32], [d16])
    assert {pick_pair(prefills, decodes, None, ())[0].url for _ in range(6)} == {"http://p:1"}
    pairs, lines = pairing_report(prefills, decodes)
    assert pairs == 1 and lines == ["prefill http://p:2 and decode http://d:1 are never paired: their fingerprints "
                                    "differ (block_size: 32 != 16)"]
    assert pick_pair(prefills, decodes, None, {"http://p:1"}) is None
    assert fingerprint_diff(FP, None) == ["fingerprint: unknown"]


def test_pick_pair_skips_unhealthy_open_excluded_and_other_models():
    p = worker("http://p:1", "prefill")
    d1, d2, d3 = worker("http://d:1", "decode"), worker("http://d:2", "decode", healthy=False), \
        worker("http://d:3", "decode")
    d3.breaker.begin()
    d3.breaker.failure()  # open
    prefills, decodes = pools([p], [d1, d2, d3])
    assert {pick_pair(prefills, decodes, "m", ())[1].url for _ in range(4)} == {"http://d:1"}
    assert pick_pair(prefills, decodes, "other-model", ()) is None
    assert pick_pair(prefills, decodes, None, {"http://d:1"}) is None


def test_leases_count_outstanding_and_end_once():
    w = worker("http://d:1", "decode")
    lease = w.lease()
    assert lease is not None and w.outstanding == 1
    lease.failure()
    lease.cancel()  # already ended: nothing more
    assert w.outstanding == 0 and not w.breaker.allows()
    assert w.lease() is None and w.outstanding == 0  # the open circuit refuses: nothing counted


def test_a_plan_is_leased_whole_or_not_at_all():
    """A breaker that opened after the pick refuses at lease time: nothing is held, so the dispatcher
    plans again without that worker (no RuntimeError, no half-taken trial)."""
    p, d = worker("http://p:1", "prefill"), worker("http://d:1", "decode")
    leases = lease_all([d, p])
    assert leases is not None and (d.outstanding, p.outstanding) == (1, 1)
    for lease in leases:
        lease.success()
    p.breaker.begin()
    p.breaker.failure()  # open (threshold 1)
    assert lease_all([d, p]) is None
    assert (d.outstanding, p.outstanding) == (0, 0) and d.breaker.allows()


async def test_a_breaker_that_opens_while_planning_sends_the_request_elsewhere():
    """The pick saw a closed circuit; by the time the plan returns (an epd plan awaits the cache) it
    opened. The dispatcher begins nothing on it: it drops the plan (its encoders' claims released)
    and plans again without that worker; none left: 503 no_healthy_worker, never a RuntimeError."""
    e, p, d = worker("http://e:1", "encoder"), worker("http://p:1", "prefill"), worker("http://d:1", "decode")
    excluded: list[set[str]] = []
    released: list[frozenset[str]] = []

    async def on_abort(urls: frozenset[str]) -> None:
        released.append(urls)

    class Planner:
        async def plan(self, call: Call, exclude) -> Plan:
            excluded.append(set(exclude))
            if exclude:
                raise RouterError(503, "no prefill", code="no_healthy_worker")
            p.breaker.begin()
            p.breaker.failure()  # opened meanwhile
            return Plan(Target("decode", d, b""), (Target("encoder", e, b""), Target("prefill", p, b"")), room=1,
                        on_abort=on_abort)

    metrics = Metrics()
    config = RouterConfig(prefill=(P,), decode=(D,))
    dispatcher = Dispatcher(config, Planner(), None, metrics, RoomLog(8))
    with pytest.raises(RouterError) as error:
        await dispatcher.handle(None, Call({}, False, None, 0.0))
    assert (error.value.status, error.value.code) == (503, "no_healthy_worker")
    assert excluded == [set(), {"http://p:1"}]
    await asyncio.gather(*dispatcher._background)
    assert released == [frozenset({"http://e:1"})]
    assert (e.outstanding, p.outstanding, d.outstanding) == (0, 0, 0) and e.breaker.allows() and d.breaker.allows()
    assert len(dispatcher.rooms) == 0  # never sent: no room recorded


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
