"""SSE in the router (router/dispatch/sse.py, tally.py): splitting a byte stream into events at
any cut, classifying each event, the fast text-choice path, the error event, and the tally that
times tokens from the events. Pure: no sockets."""

from __future__ import annotations

import random
import re

import pytest

from router.dispatch.sse import DONE_EVENT, Kind, SSESplitter, classify, error_event, text_choice
from router.dispatch.tally import Tally

pytestmark = pytest.mark.unit

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
