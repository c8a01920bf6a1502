"""Exceptions of the embedding cache. All derive from ``CacheError``.

What a caller does with each (a stage server maps them to HTTP answers):
- ``CacheUnavailable``: Redis is down, slow past the deadline, or refused the command -> 503.
- ``NotPending``: a key that is neither cached nor being encoded -> an immediate 4xx/5xx, never a wait.
- ``EncodeFailed``: the encode of a key ended ``Failed`` (``contract.claims``: reported by its encoder,
  or the claim it had taken up lapsed) -> 5xx.
- ``EncodeAbandoned`` (an ``EncodeFailed``): the encode ended ``Abandoned``, as back-pressure, not a
  failure (refused, cancelled, its write refused or timed out, its claim lapsed before the encoder
  took it up, ...) -> 503 with Retry-After (another try claims the key anew).
- ``ReadyTimeout``: the key did not land within the caller's deadline -> 504.
- ``EntryTooLarge``: one entry is larger than the whole byte budget -> the encoder reports it as failed.
- ``CorruptEntry``: raised by ``entry.unpack``; the store turns it into a miss and deletes the entry.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error the cache raises on purpose."""


class CacheUnavailable(CacheError):
    """Redis could not answer within the deadline (down, unreachable, slow, out of memory, ...)."""


class CorruptEntry(CacheError):
    """A stored entry whose metadata and payload disagree (or do not decode). Never served."""


class NotPending(CacheError):
    """The key is not in the cache and no encoder holds a claim on it."""


class EncodeFailed(CacheError):
    """The encode the waiter was waiting for ended without an entry; ``reason`` says why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"encode of image {key} failed: {reason}")
        self.key = key
        self.reason = reason


class EncodeAbandoned(EncodeFailed):
    """The encode the waiter was waiting for ended as back-pressure (``contract.claims.BACK_PRESSURE``):
    nothing is wrong with the image or the encoder, so a new try (which claims the key anew) may well
    succeed."""


class ReadyTimeout(CacheError):
    """The key was still being encoded when the waiter's deadline passed."""


class EntryTooLarge(CacheError):
    """An entry that does not fit in the byte budget even with the cache empty."""
