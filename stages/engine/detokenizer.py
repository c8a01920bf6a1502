"""Turns a request's output tokens into text deltas and finds stop strings.

Text is decoded from all output ids each time (outputs are short next to the model's cost); a
trailing U+FFFD (a multi-byte character cut in half) and the last ``len(longest stop) - 1``
characters are held back until they are known not to start a stop string.

The engine owns no tokenizer: whoever composes a stage (``stages.loading``) injects a
``TextDecoding``, whose ``detokenizer(stop)`` makes one ``Detokenizer`` per request. The engine
calls ``add`` on its own thread for every token it samples and finishes the request (STOP) once
``stopped`` is set, so stop strings end generation (and free blocks) at the step that completes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Detokenizer(Protocol):
    """One request's text. ``add`` returns the new text safe to show; ``stopped``: a stop string was
    found (everything before it has been returned, nothing after it will be)."""

    stopped: bool

    def add(self, token_ids: list[int], final: bool = False) -> str: ...


@dataclass(frozen=True)
class TextDecoding:
    """What the engine needs of the tokenizer: a fresh ``Detokenizer`` per request, given its stop
    strings, and the token ids that end a sequence (unless ``ignore_eos``)."""

    detokenizer: Callable[[tuple[str, ...]], Detokenizer]
    eos_token_ids: frozenset[int]


class IncrementalDetokenizer:
    """The ``Detokenizer`` over a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens)``)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the text already returned
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens and return the new text that is safe to show. After ``final`` or a stop
        string (``self.stopped``) everything is flushed and later calls return ''."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            text, final = text[:cut], True
        end = len(text) if final else max(self.emitted, len(text) - self.holdback)
        if not final and text[self.emitted : end].endswith("\ufffd"):
            end = self.emitted
        delta, self.emitted = text[self.emitted : end], max(self.emitted, end)
        return delta

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.emitted - self.holdback)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
