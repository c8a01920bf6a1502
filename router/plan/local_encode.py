"""Whether a request's missing images are encoded by its own prefill ("local encoding") instead of an
encoder. Pure: workers in, a yes or no out; ``router.plan.epd.EPDPlanner`` asks once per attempt.

A prefill can encode when it published an encoder id and the router's vision fingerprint (a
switchable ``stage serve pd --redis-url`` worker does, as a prefill): its encode runs under the same
single-flight claim and writes the same cache entry an encoder's would, so the answer is the same
whoever encodes. ``--local-encode``:

    never    always an encoder
    always   the prefill whenever it can
    auto     the prefill when it can and every eligible encoder is saturated: at least
             ``--local-encode-queue`` encode calls from this router in flight on each (the request would
             queue behind them while the prefill's own tower is idle), or when no encoder is eligible
             at all (all switched to other roles, or out of rotation)

Cost: one pass over the eligible encoders (already listed for the request), no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Worker(Protocol):
    encoder_id: str | None
    vision_fingerprint: str | None
    outstanding: int


def can_encode(prefill: _Worker, fingerprint: str | None) -> bool:
    """The prefill publishes an encoder id and the router's vision fingerprint."""
    return prefill.encoder_id is not None and fingerprint is not None and prefill.vision_fingerprint == fingerprint


def encode_locally(mode: str, prefill: _Worker, encoders: Sequence[_Worker], fingerprint: str | None,
                   queue: int) -> bool:
    """True: send the missing images to ``prefill`` (see the module doc for ``mode`` and ``queue``)."""
    if mode == "never" or not can_encode(prefill, fingerprint):
        return False
    return mode == "always" or not encoders or min(w.outstanding for w in encoders) >= queue
