"""What the engine needs of a grammar that constrains a request's tokens (structured output, tools).

A ``Guide`` is compiled once per request (off the event loop, by whoever prepares the request) and
rides in ``SamplingParams.guide``; the engine asks it for one ``GuideMatcher`` per sequence and keeps
that matcher with the sequence's generator and detokenizer (so it survives preemption). Per step,
for a row with a matcher, the engine calls ``mask`` on that row's logits before sampling and
``accept`` with the token drawn. When the grammar is complete the mask leaves only end-of-sequence
tokens, so the request stops as any other does; ``done`` says the grammar accepts no more tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GuideMatcher(Protocol):
    """One sequence's position in a grammar. Used by the engine thread only."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set every token the grammar forbids next to -inf in ``logits`` (one row, [vocab]) in place."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; raises ValueError if the grammar forbids it."""

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no further token."""


class Guide(Protocol):
    """A compiled grammar: immutable, shared by the sequences of one request."""

    def matcher(self) -> GuideMatcher:
        """A fresh matcher at the grammar's start."""
