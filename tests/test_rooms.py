"""Room state and prefill's pairing table: pure logic, no sockets, time passed in."""

from __future__ import annotations

import pytest

from transfer.rooms import DuplicateRoom, Room, RoomClosed, RoomStatus, RoomTable

S = RoomStatus


def test_status_order_matches_kvpoll() -> None:
    ordered = (S.Failed, S.Bootstrapping, S.WaitingForInput, S.Transferring, S.Success)
    assert [int(s) for s in ordered] == [0, 1, 2, 3, 4]


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
    assert 5 in table and table.get(5).state.status is S.Bootstrapping  # type: ignore[union-attr]
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
    table.get(1).state.fail("prefill out of memory", 1.0)  # type: ignore[union-attr]
    table.remove(1)
    assert table.closed_reason(1) == "prefill out of memory"


def test_closed_rooms_are_bounded() -> None:
    table: RoomTable[str, str] = RoomTable(closed_capacity=2)
    for room in range(3):
        table.remove(room, reason="gone")
    assert table.closed_reason(0) is None
    assert table.closed_reason(1) == table.closed_reason(2) == "gone"
    assert table.add_local(0, "reused", 0.0) is None
