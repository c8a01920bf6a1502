"""The router's reading of every kind of chunk the stages stream (``router.dispatch.sse.classify``) and its
tally of them (``router.dispatch.tally.Tally``): chat content and tool-call deltas, logprobs-only chunks,
choices of n > 1 by index, legacy ``text_completion`` chunks; each commits the answer and counts."""

from __future__ import annotations

import json

import pytest

from router.dispatch.sse import Kind, classify
from router.dispatch.tally import Tally

pytestmark = pytest.mark.unit


def event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def chat(*choices: dict, usage: dict | None = None) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": list(choices)}
    if usage is not None:
        body["usage"] = usage
    return event(body)


def delta(index: int = 0, finish: str | None = None, logprobs: dict | None = None, **fields) -> dict:
    return {"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish}


def text(index: int = 0, value: str = "", finish: str | None = None, logprobs: dict | None = None) -> bytes:
    return event({"id": "cmpl", "object": "text_completion", "created": 0, "model": "m",
                  "choices": [{"index": index, "text": value, "logprobs": logprobs, "finish_reason": finish}]})


TOOL_DELTA = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": ""}}]}
CHAT_LOGPROBS = {"content": [{"token": "x", "logprob": -0.1, "bytes": [120], "top_logprobs": []}]}
LEGACY_LOGPROBS = {"tokens": ["x"], "token_logprobs": [-0.1], "top_logprobs": [{"x": -0.1}], "text_offset": [0]}


@pytest.mark.parametrize("raw, kind, outputs", [
    (chat(delta(role="assistant", content="")), Kind.OPEN, ()),
    (chat(delta(content="hi")), Kind.TEXT, (0,)),
    (chat(delta(**TOOL_DELTA)), Kind.TEXT, (0,)),
    (chat(delta(index=0, role="assistant", content=""), delta(index=1, role="assistant", content="")), Kind.OPEN, ()),
    (chat(delta(index=1, content="b")), Kind.TEXT, (1,)),  # a later choice alone
    (chat(delta(index=0, content="a"), delta(index=3, content="b")), Kind.TEXT, (0, 3)),
    (chat(delta(logprobs=CHAT_LOGPROBS)), Kind.TEXT, (0,)),  # text held back, its logprobs sent
    (chat(delta(logprobs={"content": []})), Kind.OPEN, ()),
    (chat(delta(index=2, finish="stop")), Kind.FINISH, ()),
    (chat(delta(index=1, finish="tool_calls")), Kind.FINISH, ()),
    (chat(usage={"completion_tokens": 3}), Kind.USAGE, ()),
    (text(value="hello"), Kind.TEXT, (0,)),
    (text(index=5, value="x"), Kind.TEXT, (5,)),
    (text(value="", logprobs=LEGACY_LOGPROBS), Kind.TEXT, (0,)),
    (text(value="", finish="length"), Kind.FINISH, ()),
    (text(value=""), Kind.OPEN, ()),
])
def test_every_chunk_kind(raw, kind, outputs):
    classified = classify(raw)
    assert (classified.kind, classified.outputs) == (kind, outputs)
    assert classified.commits  # the role chunk too: a stage sends it with its first token


def test_n_choices_tally_per_sequence_tokens():
    """Two choices, three tokens each, interleaved at 0.1 s steps: TPOT is a sequence's time per token."""
    tally = Tally(started=0.0)
    tally.see(classify(chat(delta(index=0, role="assistant", content=""))), 0.05)
    times = iter([0.5, 0.5, 0.6, 0.6, 0.7, 0.7])
    for _ in range(3):
        for index in (0, 1):
            tally.see(classify(chat(delta(index=index, content="t"))), next(times))
    assert tally.ttft == pytest.approx(0.5)
    assert tally.text_events == 6 and tally.choices == {0, 1}
    assert tally.tpot == pytest.approx(0.2 / 2)
    tally.see(classify(chat(usage={"completion_tokens": 10})), 0.8)  # the stage held text back: 5 each
    assert tally.tpot == pytest.approx(0.2 / 4)


def test_one_chunk_of_several_choices_counts_each():
    tally = Tally(started=0.0)
    tally.see(classify(chat(delta(index=0, content="a"), delta(index=1, content="b"))), 1.0)
    tally.see(classify(chat(delta(index=0, content="a"), delta(index=1, content="b"))), 1.5)
    assert tally.text_events == 4 and tally.tpot == pytest.approx(0.5)


def test_completion_chunks_and_tool_calls_are_timed():
    tally = Tally(started=0.0)
    for raw, now in ((text(value="a"), 0.2), (text(value="", logprobs=LEGACY_LOGPROBS), 0.3), (text(value="c"), 0.4)):
        tally.see(classify(raw), now)
    assert tally.ttft == pytest.approx(0.2) and tally.tpot == pytest.approx(0.1)
    tools = Tally(started=0.0)
    tools.see(classify(chat(delta(**TOOL_DELTA))), 0.3)
    assert tools.ttft == pytest.approx(0.3)
