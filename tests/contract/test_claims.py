"""The image-claim state machine (``contract.claims``): pure, no Redis."""

from __future__ import annotations

import itertools

import pytest

from contract.claims import (BACK_PRESSURE, ENDED, HELD, RETRY_AFTER_S, TRANSITIONS, ClaimState, EncodeEnd,
                             ended_status, ending_state, lapsed, moves)

pytestmark = pytest.mark.unit
C = ClaimState
# Every move a key makes, written out (not derived from the table under test). Everything else is refused.
ALLOWED = {
    (C.Unclaimed, C.Claimed), (C.Unclaimed, C.Encoding), (C.Unclaimed, C.Cached),
    (C.Claimed, C.Encoding), (C.Claimed, C.Claimed), (C.Claimed, C.Abandoned), (C.Claimed, C.Unclaimed),
    (C.Encoding, C.Encoding), (C.Encoding, C.Claimed), (C.Encoding, C.Cached), (C.Encoding, C.Abandoned),
    (C.Encoding, C.Failed), (C.Encoding, C.Unclaimed),
    (C.Abandoned, C.Unclaimed), (C.Failed, C.Unclaimed),
    (C.Cached, C.Cached), (C.Cached, C.Unclaimed),
}


@pytest.mark.parametrize("current, new", list(itertools.product(ClaimState, repeat=2)))
def test_every_move_is_allowed_exactly_when_written_out(current: ClaimState, new: ClaimState) -> None:
    assert moves(current, new) is ((current, new) in ALLOWED)


def test_every_allowed_move_names_the_call_that_makes_it() -> None:
    assert set(TRANSITIONS) == ALLOWED and all(TRANSITIONS.values())


def test_only_the_router_s_claim_is_abandoned_and_only_its_holder_ends_an_encode() -> None:
    assert [s for s in ClaimState if moves(s, C.Abandoned)] == [C.Claimed, C.Encoding]
    assert [s for s in ClaimState if moves(s, C.Failed)] == [C.Encoding]  # a failure needs an encode
    assert [s for s in ClaimState if moves(s, C.Cached)] == [C.Unclaimed, C.Encoding, C.Cached]
    assert not moves(C.Claimed, C.Cached)  # the encoder takes the claim up (renew) before it writes


def test_an_ended_encode_leaves_the_key_unclaimed_at_once_and_says_nothing_more() -> None:
    for ended in (C.Abandoned, C.Failed):
        assert [s for s in ClaimState if moves(ended, s)] == [C.Unclaimed]


def test_waiters_hear_one_event_per_end_and_none_for_a_held_or_free_key() -> None:
    assert {s: s.event for s in ENDED} == {C.Cached: "ready", C.Abandoned: "abandoned", C.Failed: "failed"}
    for state in (C.Unclaimed, *HELD):
        with pytest.raises(ValueError, match="no event tells"):
            state.event  # noqa: B018


# How every end maps, written out: back-pressure is everything that says nothing about the image.
ENDS = {
    EncodeEnd.ENCODED: C.Cached,
    EncodeEnd.REFUSED: C.Abandoned,
    EncodeEnd.CANCELLED: C.Abandoned,
    EncodeEnd.CACHE_REFUSED: C.Abandoned,
    EncodeEnd.CLAIM_LAPSED: C.Abandoned,
    EncodeEnd.TIMED_OUT: C.Abandoned,
    EncodeEnd.SHUTDOWN: C.Abandoned,
    EncodeEnd.ENCODE_ERROR: C.Failed,
    EncodeEnd.TOO_LARGE: C.Failed,
    EncodeEnd.HOLDER_LAPSED: C.Failed,
}


@pytest.mark.parametrize("end", list(EncodeEnd))
def test_every_end_is_back_pressure_a_failure_or_an_entry(end: EncodeEnd) -> None:
    assert ending_state(end) is ENDS[end]
    assert (end in BACK_PRESSURE) is (ENDS[end] is C.Abandoned)
    assert moves(C.Encoding, ending_state(end))  # the holder can make every end


def test_a_waiter_answers_503_with_retry_after_for_back_pressure_and_502_for_a_failure() -> None:
    assert (ended_status(C.Abandoned), ended_status(C.Failed), RETRY_AFTER_S) == (503, 502, 1)
    for state in (C.Unclaimed, C.Claimed, C.Encoding, C.Cached):
        with pytest.raises(ValueError, match="did not end without an entry"):
            ended_status(state)


def test_a_lapse_is_back_pressure_before_the_encoder_took_the_claim_up_and_a_failure_after() -> None:
    assert lapsed(C.Claimed) is EncodeEnd.CLAIM_LAPSED and ending_state(lapsed(C.Claimed)) is C.Abandoned
    assert lapsed(C.Encoding) is EncodeEnd.HOLDER_LAPSED and ending_state(lapsed(C.Encoding)) is C.Failed
    for state in (C.Unclaimed, *ENDED):
        with pytest.raises(ValueError, match="cannot lapse"):
            lapsed(state)
