"""Server-sent events from a stage, split and read just enough to relay them. Pure.

The router forwards the stage's bytes unchanged; it only needs to know, per event, whether it is
the opening role chunk, a chunk with generated output, a usage chunk, an in-band error, the final
``[DONE]`` or a comment (the stages' ``: keep-alive``, forwarded once the answer is under way).

Generated output (``Kind.TEXT``), in any choice of the chunk (``n`` > 1 choices come by ``index``):
a chat delta's ``content`` or ``tool_calls``, a completions choice's ``text`` (``text_completion``
chunks), or non-empty ``logprobs`` alone (a token whose text the stage holds back still has its
logprobs). ``Event.outputs`` names the choices that carried output, for the tally.

Once the answer is committed, most events are chunks of one choice whose delta opens with text, and
``text_choice`` finds those, and their choice's index, in the bytes without decoding them (no JSON
decode, no ``Event``); every other event (tool calls, logprobs alone, several choices, completions'
``text``, the finish and usage chunks, an error, ``[DONE]``, a comment, any other shape) goes
through ``classify``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import msgspec

_BOUNDARY = re.compile(rb"\r?\n\r?\n")
_json = msgspec.json.Decoder()


class Kind(Enum):
    OPEN = "open"  # a chunk without text: the role chunk, or an empty delta
    TEXT = "text"  # a chunk where a choice carries output: content, tool_calls, text or logprobs
    FINISH = "finish"  # a chunk with a finish_reason and no content
    USAGE = "usage"  # the usage chunk (choices == [])
    ERROR = "error"  # {"error": {...}}: the stage failed after the stream started
    DONE = "done"  # data: [DONE]
    COMMENT = "comment"  # only comment lines (": keep-alive"): not an event to an SSE client; the tally skips it
    OTHER = "other"  # anything else


@dataclass(frozen=True)
class Event:
    raw: bytes  # the event's bytes including its blank-line terminator
    kind: Kind
    body: dict | None = None  # the decoded JSON (None for DONE and most OTHER)
    outputs: tuple[int, ...] = ()  # TEXT: the index of each choice that carried output

    @property
    def commits(self) -> bool:
        """Past this event the answer is under way: it reaches the client and cannot be retried. The
        role chunk commits too: a stage sends it with its first token, never before
        (``stages.api.routes``), so it opens the answer and waits for nothing."""
        return self.kind in (Kind.OPEN, Kind.TEXT, Kind.FINISH, Kind.USAGE, Kind.DONE)


class SSESplitter:
    """Feed it bytes as they arrive; it returns the complete events, keeping a partial one."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        if not self._pending and data.find(b"\n\n") == len(data) - 2 and b"\r" not in data:
            return [data]  # the common piece: one whole event (its only boundary is its end)
        buffer = self._pending + data
        events: list[bytes] = []
        start = 0
        for match in _BOUNDARY.finditer(buffer):
            events.append(buffer[start:match.end()])
            start = match.end()
        self._pending = buffer[start:]
        return events

    @property
    def pending(self) -> bytes:
        return self._pending


def classify(raw: bytes) -> Event:
    """What one complete event is (see ``Kind``)."""
    lines = raw.splitlines()
    data = b"".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
    if not data:
        fields = [line for line in lines if line]
        return Event(raw, Kind.COMMENT if fields and all(line.startswith(b":") for line in fields) else Kind.OTHER)
    if data == b"[DONE]":
        return Event(raw, Kind.DONE)
    try:
        body = _json.decode(data)
    except msgspec.DecodeError:
        return Event(raw, Kind.OTHER)
    if not isinstance(body, dict):
        return Event(raw, Kind.OTHER)
    if "error" in body:
        return Event(raw, Kind.ERROR, body)
    choices = body.get("choices")
    if choices == [] and body.get("usage"):
        return Event(raw, Kind.USAGE, body)
    if not choices or not isinstance(choices, list):
        return Event(raw, Kind.OTHER, body)
    dicts = [choice for choice in choices if isinstance(choice, dict)]
    outputs = tuple(_index(choice, i) for i, choice in enumerate(dicts) if _carries_output(choice))
    if outputs:
        return Event(raw, Kind.TEXT, body, outputs)
    if any(choice.get("finish_reason") for choice in dicts):
        return Event(raw, Kind.FINISH, body)
    return Event(raw, Kind.OPEN if dicts else Kind.OTHER, body)


def _carries_output(choice: dict) -> bool:
    """A chat delta's content or tool calls, a completion's text, or logprobs of any format."""
    delta = choice.get("delta")
    if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
        return True
    logprobs = choice.get("logprobs")
    return bool(choice.get("text")) or isinstance(logprobs, dict) and any(logprobs.values())


def _index(choice: dict, position: int) -> int:
    index = choice.get("index")
    return index if type(index) is int else position


_TEXT_DELTA = b'"delta":{"content":"'
_INDEX = b'"index":'


def text_choice(raw: bytes) -> int | None:
    """A cheap, sure test for the common event after commit: the index of the one choice whose output
    ``raw`` carries, when ``raw`` is one ``data:`` line (``\n\n``-terminated) of an object with one
    ``"delta"``, which opens with a non-empty ``content`` string, at most one ``"index"`` (an int;
    none: choice 0), and no ``"error"`` anywhere: ``classify`` would call it ``TEXT`` with that one
    output. Bare quotes cannot occur inside a JSON string, so the keys it looks for are keys. None
    means "ask ``classify``", not "not text"."""
    if not raw.startswith(b"data:") or raw.find(b"\n") != len(raw) - 2 or not raw.endswith(b"}\n\n"):
        return None
    at = raw.find(_TEXT_DELTA)
    if at < 0 or raw[at + len(_TEXT_DELTA)] == 0x22 or raw.count(b'"delta"') != 1 or b'"error"' in raw:
        return None  # no content, an empty one, several choices, or an error: classify decides
    at = raw.find(_INDEX)
    if at < 0:
        return 0
    end = at + len(_INDEX)
    stop = end
    while raw[stop] in b"0123456789":
        stop += 1
    if stop == end or raw[stop] not in b",}" or raw.find(_INDEX, stop) >= 0:
        return None
    return int(raw[end:stop])


DONE_EVENT = b"data: [DONE]\n\n"


def error_event(body: dict) -> bytes:
    """An in-band error event (the OpenAI error body); ``DONE_EVENT`` follows it when the stream ends."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
