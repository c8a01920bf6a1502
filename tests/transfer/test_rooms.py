"""Room state, prefill's pairing table and the timeline that follows a room: pure logic, no sockets,
time passed in."""

from __future__ import annotations

import itertools

import pytest

from stages.timeline import RoomTimeline
from transfer.rooms import DuplicateRoom, Room, RoomClosed, RoomStatus, RoomTable, moves

pytestmark = pytest.mark.unit

S = RoomStatus
# Every transition a room makes, written out (not derived from the rule under test): forward from a
# live status, or to Failed from a live status. Everything else is refused.
ALLOWED = {
    (S.Bootstrapping, S.WaitingForInput), (S.Bootstrapping, S.Transferring), (S.Bootstrapping, S.Success),
    (S.Bootstrapping, S.Failed),
    (S.WaitingForInput, S.Transferring), (S.WaitingForInput, S.Success), (S.WaitingForInput, S.Failed),
    (S.Transferring, S.Success), (S.Transferring, S.Failed),
}


def test_status_order_matches_kvpoll() -> None:
    ordered = (S.Failed, S.Bootstrapping, S.WaitingForInput, S.Transferring, S.Success)
    assert [int(s) for s in ordered] == [0, 1, 2, 3, 4]
    assert [s.label for s in ordered] == ["failed", "bootstrapping", "waiting_for_input", "transferring", "success"]


def _room_in(status: RoomStatus) -> Room:
    """A room that entered ``status`` at t=1 the way a real one does (Failed with a reason)."""
    room = Room.new(7, now=0.0)
    if status is not S.Bootstrapping:
        assert room.advance(status, 1.0, reason="first failure" if status is S.Failed else None)
    return room


@pytest.mark.parametrize(("current", "new"), list(itertools.product(S, S)),
                         ids=lambda s: s.name)
def test_every_transition_is_allowed_or_refused(current: RoomStatus, new: RoomStatus) -> None:
    changes: list[tuple[RoomStatus, str | None]] = []
    room = _room_in(current)
    room.on_change = lambda state: changes.append((state.status, state.reason))
    before = (room.status, room.reason, dict(room.times))
    reason = "late failure" if new is S.Failed else None
    allowed = (current, new) in ALLOWED
    assert moves(current, new) is allowed
    assert room.advance(new, 2.0, reason) is allowed
    if allowed:
        assert (room.status, room.times[new], changes) == (new, 2.0, [(new, reason)])
        assert room.reason == reason
    else:  # the higher (or final) status is kept, with its time and first reason; nobody is told
        assert (room.status, room.reason, room.times, changes) == (*before, [])


def test_on_change_sees_every_status_entered_from_the_first() -> None:
    seen: list[RoomStatus] = []
    room = Room.new(3, now=0.0, on_change=lambda state: seen.append(state.status))
    room.advance(S.WaitingForInput, 1.0)
    room.advance(S.Bootstrapping, 1.5)  # stale: ignored, not told
    room.advance(S.Transferring, 2.0)
    room.fail("decode aborted", 3.0)
    room.fail("second", 4.0)
    assert seen == [S.Bootstrapping, S.WaitingForInput, S.Transferring, S.Failed]
    assert room.failed and room.finished and room.reason == "decode aborted"


def test_room_moves_forward_and_records_times() -> None:
    room = Room.new(7, now=1.0)
    assert room.status is S.Bootstrapping and room.times == {S.Bootstrapping: 1.0}
    assert room.advance(S.WaitingForInput, 2.0)
    assert room.advance(S.Success, 4.0)  # skipping Transferring is forward too
    assert room.status is S.Success and room.finished
    assert room.times == {S.Bootstrapping: 1.0, S.WaitingForInput: 2.0, S.Success: 4.0}
    assert room.reason is None


def test_room_ignores_backward_and_repeated_steps() -> None:
    room = Room.new(7, now=0.0)
    assert room.advance(S.Transferring, 1.0)
    assert not room.advance(S.WaitingForInput, 2.0)
    assert not room.advance(S.Transferring, 3.0)
    assert room.status is S.Transferring and room.times[S.Transferring] == 1.0
    assert S.WaitingForInput not in room.times


def test_failed_is_final_and_keeps_first_reason() -> None:
    room = Room.new(7, now=0.0)
    assert room.fail("prefill crashed", 1.0)
    assert not room.fail("second reason", 2.0)
    assert not room.advance(S.Success, 3.0)
    assert room.status is S.Failed and room.reason == "prefill crashed" and room.times[S.Failed] == 1.0


def test_failure_after_success_is_refused() -> None:
    room = Room.new(7, now=0.0)
    room.advance(S.Success, 1.0)
    assert not room.fail("late abort", 2.0)
    assert room.status is S.Success and room.reason is None and S.Failed not in room.times


def test_failure_needs_a_reason() -> None:
    with pytest.raises(ValueError):
        Room.new(7, now=0.0).advance(S.Failed, 1.0)


def test_table_pairs_local_first() -> None:
    table: RoomTable[str, str] = RoomTable()
    assert table.add_local(5, "http", now=1.0) is None
    assert 5 in table and table.get(5).state.status is S.Bootstrapping
    entry = table.add_remote(5, "kvreq", now=2.0)
    assert entry is not None and entry.paired
    assert (entry.room, entry.local, entry.remote) == (5, "http", "kvreq")
    assert entry.state.status is S.WaitingForInput and entry.state.times[S.WaitingForInput] == 2.0


def test_table_pairs_remote_first() -> None:
    table: RoomTable[str, str] = RoomTable()
    assert table.add_remote(5, "kvreq", now=1.0) is None
    entry = table.add_local(5, "http", now=3.0)
    assert entry is not None and (entry.local_at, entry.remote_at) == (3.0, 1.0)


def test_table_keeps_rooms_apart() -> None:
    table: RoomTable[int, int] = RoomTable()
    for room in range(10):
        assert table.add_local(room, room, now=0.0) is None
    for room in reversed(range(10)):
        entry = table.add_remote(room, -room, now=1.0)
        assert entry is not None and (entry.local, entry.remote) == (room, -room)
    assert len(table) == 10


@pytest.mark.parametrize("half", ["local", "remote"])
def test_duplicate_half_is_an_error(half: str) -> None:
    table: RoomTable[str, str] = RoomTable()
    add = table.add_local if half == "local" else table.add_remote
    add(5, "x", 0.0)
    with pytest.raises(DuplicateRoom) as info:
        add(5, "y", 1.0)
    assert info.value.room == 5
    entry = table.get(5)
    assert entry is not None and getattr(entry, half) == "x" and not entry.paired


def test_check_local_asks_what_add_local_would_answer_and_changes_nothing() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.check_local(5)  # a new room: fine, and still not in the table
    assert 5 not in table
    table.add_remote(5, "kvreq", 0.0)
    table.check_local(5)  # the decode's half alone: fine
    table.add_local(5, "http", 0.0)
    with pytest.raises(DuplicateRoom, match="prefill's own request arrived twice"):
        table.check_local(5)
    table.remove(5, "aborted by decode")
    with pytest.raises(RoomClosed, match="room 5 is closed: aborted by decode"):
        table.check_local(5)
    assert 5 not in table


def test_duplicate_after_pairing_is_an_error() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(5, "a", 0.0)
    table.add_remote(5, "b", 0.0)
    with pytest.raises(DuplicateRoom):
        table.add_remote(5, "c", 1.0)


def test_expire_fails_unpaired_rooms_past_deadline() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(1, "http", now=0.0)  # decode never comes
    table.add_remote(2, "kvreq", now=0.0)  # prefill's own request never comes
    table.add_remote(3, "kvreq", now=8.0)  # not old enough
    table.add_local(4, "http", now=0.0)
    table.add_remote(4, "kvreq", now=1.0)  # paired: never expired here
    assert table.expire(now=9.9, deadline_s=10.0) == []
    expired = table.expire(now=10.0, deadline_s=10.0)
    assert sorted(e.room for e in expired) == [1, 2]
    by_room = {e.room: e for e in expired}
    for entry in expired:
        assert entry.state.status is S.Failed and entry.state.times[S.Failed] == 10.0
    assert by_room[1].state.reason == "partner never arrived within 10 s (decode's KV request missing)"
    assert by_room[2].state.reason == "partner never arrived within 10 s (prefill's own request missing)"
    assert by_room[1].local == "http" and by_room[2].remote == "kvreq"
    assert 1 not in table and 2 not in table and 3 in table and 4 in table
    assert [e.room for e in table.expire(now=100.0, deadline_s=10.0)] == [3]


def test_late_half_of_an_expired_room_is_refused() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(1, "http", now=0.0)
    table.expire(now=5.0, deadline_s=0.5)
    with pytest.raises(RoomClosed, match="partner never arrived within 0.5 s"):
        table.add_remote(1, "kvreq", now=6.0)


def test_remove_closes_the_room() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(1, "a", 0.0)
    table.add_remote(1, "b", 0.0)
    entry = table.remove(1)
    assert entry is not None and entry.room == 1 and 1 not in table and len(table) == 0
    assert table.remove(1) is None
    assert table.closed_reason(1) == "already finished"
    with pytest.raises(RoomClosed, match="room 1 is closed: already finished"):
        table.add_local(1, "again", 1.0)


def test_remove_with_reason_closes_even_an_absent_room() -> None:
    table: RoomTable[str, str] = RoomTable()
    assert table.remove(9, reason="aborted by decode: client disconnected") is None
    with pytest.raises(RoomClosed, match="aborted by decode: client disconnected"):
        table.add_local(9, "late", 1.0)


def test_remove_remembers_a_failed_rooms_reason() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(1, "a", 0.0)
    table.get(1).state.fail("prefill out of memory", 1.0)
    table.remove(1)
    assert table.closed_reason(1) == "prefill out of memory"


def test_closed_rooms_are_bounded() -> None:
    table: RoomTable[str, str] = RoomTable(closed_capacity=2)
    for room in range(3):
        table.remove(room, reason="gone")
    assert table.closed_reason(0) is None
    assert table.closed_reason(1) == table.closed_reason(2) == "gone"
    assert table.add_local(0, "reused", 0.0) is None


def test_table_gives_its_rooms_the_listener_and_pairs_through_the_state() -> None:
    seen: list[tuple[int, RoomStatus]] = []
    table: RoomTable[str, str] = RoomTable(on_change=lambda state: seen.append((state.room, state.status)))
    table.add_remote(5, "kvreq", now=1.0)
    assert not table.get(5).paired
    entry = table.add_local(5, "http", now=2.0)
    assert entry is not None and entry.paired
    entry.state.fail("decode aborted", 3.0)
    assert entry.paired  # it met its partner once: a failed room stays paired
    assert seen == [(5, S.Bootstrapping), (5, S.WaitingForInput), (5, S.Failed)]


def test_expire_reads_the_status_a_room_failed_by_its_owner_is_not_expired_again() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(1, "http", now=0.0)
    table.add_local(2, "http", now=0.0)
    table.get(2).state.fail("its inputs failed", 0.5)
    assert [e.room for e in table.expire(now=10.0, deadline_s=1.0)] == [1]
    assert table.get(2).state.reason == "its inputs failed"


def test_fail_fails_the_state_removes_the_room_and_refuses_a_late_half_with_the_reason() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_remote(1, "kvreq", now=0.0)
    entry = table.fail(1, "decode aborted: client gone", 2.0)
    assert entry is not None and entry.remote == "kvreq" and 1 not in table
    assert (entry.state.status, entry.state.reason) == (S.Failed, "decode aborted: client gone")
    assert entry.state.times[S.Failed] == 2.0
    with pytest.raises(RoomClosed, match="room 1 is closed: decode aborted: client gone"):
        table.add_local(1, "http", 3.0)
    assert table.fail(2, "aborted before it came", 4.0) is None  # an absent room: closed with the reason
    with pytest.raises(RoomClosed, match="room 2 is closed: aborted before it came"):
        table.add_remote(2, "kvreq", 5.0)


def test_fail_keeps_the_first_reason_of_a_room_already_failed() -> None:
    table: RoomTable[str, str] = RoomTable()
    table.add_local(1, "http", now=0.0)
    table.get(1).state.fail("first", 1.0)
    entry = table.fail(1, "second", 2.0)
    assert entry is not None and entry.state.reason == "first" and table.closed_reason(1) == "first"


def test_the_timeline_follows_a_room_status_and_names_its_events() -> None:
    timeline = RoomTimeline()
    follow = timeline.follow({S.WaitingForInput: "paired", S.Success: "ready_sent", S.Failed: "failed"})
    table: RoomTable[str, str] = RoomTable(on_change=follow)
    table.add_local(1, "http", now=0.0)
    assert timeline.snapshot(1) == ([], S.Bootstrapping)  # a status with no event name: only kept
    table.add_remote(1, "kvreq", now=0.1)
    timeline.mark(1, "prefilled", prompt_tokens=9)  # a plain event: no status change
    table.get(1).state.advance(S.Transferring, 0.2)
    table.get(1).state.advance(S.Success, 0.3)
    table.get(1).state.fail("too late", 0.4)  # refused: neither kept nor marked
    events, status = timeline.snapshot(1)
    assert [e["event"] for e in events] == ["paired", "prefilled", "ready_sent"] and status is S.Success
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)

    table.add_remote(2, "kvreq", now=1.0)
    table.fail(2, "decode aborted: gone", 1.5)
    events, status = timeline.snapshot(2)
    assert status is S.Failed and [(e["event"], e["reason"]) for e in events] == [("failed", "decode aborted: gone")]
    timeline.mark(3, "queued", images=1)  # a room without a state (the encoder's)
    assert timeline.snapshot(3)[1] is None and timeline.snapshot(4) is None
