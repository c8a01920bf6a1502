"""Image claims: the states of one image key in the embedding cache, who moves it, and how an encode's
end reaches the requests waiting for it. Pure: no I/O, no clock.

A key (``cache.keys.image_key``) is shared by every process of a deployment; four writers in three
processes move it, each only along the transitions below (``cache.scripts`` holds the Lua that makes
each one atomic, ``cache.store.EmbeddingCache`` the one call per transition):

1. ``Unclaimed``: no entry, no claim. The router claims it for the encoder it picked (-> ``Claimed``:
   ``lookup_claim`` / ``claim_many``); an encoder sent the image unclaimed claims it itself
   (-> ``Encoding``: ``claim``).
2. ``Claimed``: held in an encoder's name by the router; that encoder has not taken it up yet. The
   encoder takes it when the image is queued there (-> ``Encoding``: ``renew``); the router gives it
   up when that encoder refused or never got its request (-> ``Abandoned``: ``abandon``).
3. ``Encoding``: the encoder holds it and renews it every third of its lease. The encode ends
   (``EncodeEnd``, mapped by ``ending_state``): its entry written (-> ``Cached``: ``put``), given up
   under back-pressure (-> ``Abandoned``: ``end``), or failed (-> ``Failed``: ``end``).
4. ``Abandoned`` / ``Failed``: told to every waiter (an event on the channel) in the same step that
   drops the claim, so the key is ``Unclaimed`` again at once; a new try claims it anew.
5. ``Cached``: read by the prefills (``get`` / ``wait_ready``) until evicted or expired (-> ``Unclaimed``).

Two moves take no word from the holder:
- a claim that lapses drops back to ``Unclaimed``; a waiter tells how that encode ended by the state
  it saw last (``lapsed``): one the router held for an encoder too slow to take it up is
  back-pressure, one the encoder held means it died, froze or was cut off;
- the router takes over a claim held for an encoder it will not send to (excluded after failing
  this request, or out of rotation) for the encoder it picked instead (``Claimed``/``Encoding`` ->
  ``Claimed``: ``lookup_claim`` / ``claim_many`` with ``takeover``), so a retry does not wait on an
  encoder that left.

What a waiter (the prefill) answers is ``ended_status`` of the state the encode ended in: an abandoned
encode is back-pressure (503 with ``Retry-After``: nothing is wrong with the image or any encoder;
the router charges nobody and retries), a failed one a failure (502; the router charges the encoder
it sent the image to). Only a real encode failure is a failure.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Literal

EventKind = Literal["ready", "abandoned", "failed"]  # what a waiter hears (``cache.readiness.Event.kind``)


class ClaimState(IntEnum):
    """Where one image key stands (module docstring, steps 1-5)."""

    Unclaimed = 0
    Claimed = 1  # held by the router for an encoder
    Encoding = 2  # held by the encoder itself
    Cached = 3
    Abandoned = 4  # ended without an entry, given up: back-pressure
    Failed = 5  # ended without an entry: the encode failed

    @property
    def event(self) -> EventKind:
        """The kind of event a waiter hears when a key enters this state (``cache.readiness.Event``):
        ``ready``, ``abandoned`` or ``failed``; ValueError for a state nobody is told of."""
        if self not in ENDED:
            raise ValueError(f"no event tells of a key entering {self.name}")
        if self is ClaimState.Cached:
            return "ready"
        return "abandoned" if self is ClaimState.Abandoned else "failed"


ENDED = frozenset({ClaimState.Cached, ClaimState.Abandoned, ClaimState.Failed})
HELD = frozenset({ClaimState.Claimed, ClaimState.Encoding})

# every allowed move -> the cache call that makes it (module docstring)
TRANSITIONS: dict[tuple[ClaimState, ClaimState], str] = {
    (ClaimState.Unclaimed, ClaimState.Claimed): "lookup_claim / claim_many (the router, for an encoder)",
    (ClaimState.Unclaimed, ClaimState.Encoding): "claim (an encoder, for itself)",
    (ClaimState.Claimed, ClaimState.Encoding): "renew (the encoder takes up the router's claim)",
    (ClaimState.Claimed, ClaimState.Claimed): "lookup_claim / claim_many with takeover (for another encoder)",
    (ClaimState.Encoding, ClaimState.Claimed): "lookup_claim / claim_many with takeover (for another encoder)",
    (ClaimState.Encoding, ClaimState.Encoding): "renew (the lease restarts)",
    (ClaimState.Claimed, ClaimState.Abandoned): "abandon (the router: the encoder refused or never got it)",
    (ClaimState.Encoding, ClaimState.Cached): "put (the entry written, the claim dropped)",
    (ClaimState.Encoding, ClaimState.Abandoned): "end (given up under back-pressure)",
    (ClaimState.Encoding, ClaimState.Failed): "end (the encode failed)",
    (ClaimState.Claimed, ClaimState.Unclaimed): "the lease lapses",
    (ClaimState.Encoding, ClaimState.Unclaimed): "the lease lapses",
    (ClaimState.Abandoned, ClaimState.Unclaimed): "at once, in the same step",
    (ClaimState.Failed, ClaimState.Unclaimed): "at once, in the same step",
    (ClaimState.Cached, ClaimState.Unclaimed): "eviction or expiry",
    (ClaimState.Unclaimed, ClaimState.Cached): "put (an encoder that lost its claim still writes its entry)",
    (ClaimState.Cached, ClaimState.Cached): "put (the entry replaced)",
}


def moves(current: ClaimState, new: ClaimState) -> bool:
    """Whether a key in ``current`` may enter ``new`` (``TRANSITIONS``)."""
    return (current, new) in TRANSITIONS


class EncodeEnd(Enum):
    """How one encode of a key ended, as its holder (or the router, for its encoder) saw it."""

    ENCODED = "encoded"  # the entry is written
    REFUSED = "refused"  # the encoder refused the request (at its limits) or never got it: the router's word
    CANCELLED = "cancelled"  # every request waiting for it went away while it was queued
    CACHE_REFUSED = "cache_refused"  # the entry's write failed: Redis refused it or did not answer in time
    CLAIM_LAPSED = "claim_lapsed"  # the router's claim lapsed before its encoder took the image up (too slow to)
    TIMED_OUT = "timed_out"  # not encoded within --encode-timeout-s: the encoder thread was behind
    SHUTDOWN = "shutdown"  # the encoder stopped (drained) before it ended
    ENCODE_ERROR = "encode_error"  # the vision tower failed on the image, or gave wrong rows
    TOO_LARGE = "too_large"  # the entry is larger than the whole cache budget
    HOLDER_LAPSED = "holder_lapsed"  # the encoder's own claim lapsed unended: it died, froze or was cut off


# the ends that are back-pressure: nothing is wrong with the image or any encoder, a new try may succeed
BACK_PRESSURE = frozenset({EncodeEnd.REFUSED, EncodeEnd.CANCELLED, EncodeEnd.CACHE_REFUSED, EncodeEnd.CLAIM_LAPSED,
                           EncodeEnd.TIMED_OUT, EncodeEnd.SHUTDOWN})


def ending_state(end: EncodeEnd) -> ClaimState:
    """The state an encode that ended so leaves its key in: ``Cached``, ``Abandoned`` (back-pressure)
    or ``Failed``. The one place that says which ends are failures."""
    if end is EncodeEnd.ENCODED:
        return ClaimState.Cached
    return ClaimState.Abandoned if end in BACK_PRESSURE else ClaimState.Failed


def lapsed(last: ClaimState) -> EncodeEnd:
    """How an encode ended whose claim a waiter saw vanish with no word and no entry, by the state
    it saw last: a claim the router held for an encoder that never took it up (``Claimed``: that
    encoder was too slow to, or never got the request) is back-pressure; one the encoder itself held
    (``Encoding``) means the encoder stopped (died, froze, cut off): a failure."""
    if last not in HELD:
        raise ValueError(f"a claim in {last.name} cannot lapse")
    return EncodeEnd.CLAIM_LAPSED if last is ClaimState.Claimed else EncodeEnd.HOLDER_LAPSED


RETRY_AFTER_S = 1  # the Retry-After of a waiter's answer about an abandoned encode


def ended_status(state: ClaimState) -> int:
    """The HTTP status of a waiter's answer about an encode that ended without an entry: 503 (with
    ``Retry-After: RETRY_AFTER_S``) for ``Abandoned``, 502 for ``Failed``."""
    if state is ClaimState.Abandoned:
        return 503
    if state is ClaimState.Failed:
        return 502
    raise ValueError(f"a key in {state.name} did not end without an entry")
