"""What one chat completion SSE stream showed, fed the bytes as they arrive with their arrival time. Pure.

A *token chunk* is an event whose first choice's ``delta`` carries non-empty ``content`` (or
``reasoning_content``); the opening role-only chunk, finish-only chunks and the usage chunk are not.
Bytes that arrive in one read share its timestamp (they reached the client together)."""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field


@dataclass
class StreamTally:
    """Fed by ``feed(data, now)`` for each read of the response body, then ``close()`` once."""

    token_times: list[float] = field(default_factory=list)  # arrival time of each token chunk
    pieces: list[str] = field(default_factory=list)  # the token chunks' text
    usage: dict | None = None  # the last non-null ``usage`` seen
    finish_reason: str | None = None
    error: str | None = None  # an in-band error event, or an unreadable event
    done: bool = False  # ``data: [DONE]`` seen
    _decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _buffer: str = ""

    def feed(self, data: bytes, now: float) -> None:
        """Take one read of the body; every complete event in it is counted at ``now``."""
        self._buffer += self._decoder.decode(data).replace("\r\n", "\n")
        *events, self._buffer = self._buffer.split("\n\n")
        for event in events:
            self._event(event, now)

    def close(self, now: float) -> None:
        """The body ended: a last event without its blank line still counts."""
        self._buffer += self._decoder.decode(b"", final=True)
        if self._buffer.strip():
            self._event(self._buffer, now)
        self._buffer = ""

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _event(self, event: str, now: float) -> None:
        data = "\n".join(line[5:].lstrip(" ") for line in event.split("\n") if line.startswith("data:"))
        if not data:
            return  # a comment or a field we do not use
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            body = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"unreadable SSE event: {data[:120]!r}"
            return
        if not isinstance(body, dict):
            self.error = self.error or f"unreadable SSE event: {data[:120]!r}"
            return
        if body.get("error") is not None:
            self.error = self.error or error_message(body)
            return
        if body.get("usage"):
            self.usage = body["usage"]
        choices = body.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        delta = choice.get("delta") or {}
        piece = delta.get("content") or delta.get("reasoning_content")
        if piece:
            self.token_times.append(now)
            self.pieces.append(piece)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]


def error_message(body: object) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}``), else the body, shortened."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
    return json.dumps(body)[:200]
