"""Per-room state of a KV handover, and prefill's table that pairs the two halves of a room.

Pure logic: no sockets, no clocks. Every method that needs the time takes ``now`` (seconds, from any
monotonic clock the caller chooses, the same one for every call on one object).

A room is one request's identity across the stages. On the prefill server (P) a room has two
halves that arrive in either order: P's own request from the router (the *local* half) and decode's
``KVRequest`` over the bootstrap socket (the *remote* half). ``RoomTable`` holds a room until both
halves are present, then hands the pair to its owner, and fails rooms whose partner never comes.

A ``Room`` is the one record of where a room's handover stands, on either stage: its owner changes
it only through ``advance`` / ``fail``, reads it to decide (an aborted room is a ``Failed`` one), and
whoever shows the room (the stage's timeline, ``stages.timeline``) follows it through ``on_change``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, TypeVar


class RoomStatus(IntEnum):
    """Ordered like SGLang's ``KVPoll``: a room only moves up; ``Failed`` is below all and final.

    On the prefill: ``Bootstrapping`` when the first half arrives, ``WaitingForInput`` when paired,
    ``Transferring`` when its prefill is done and the KV write into the decode's blocks starts,
    ``Success`` when the decode is told ``KVReady``. On the decode (``transfer.bootstrap_client``):
    ``Bootstrapping`` when its ``KVRequest`` is sent, ``WaitingForInput`` when the prefill accepted it,
    ``Success`` when ``KVReady`` came. ``Failed`` from anywhere before ``Success``.
    """

    Failed = 0
    Bootstrapping = 1  # one half known, waiting for the partner
    WaitingForInput = 2  # paired; waiting for inputs (image embeddings) and a prefill slot
    Transferring = 3  # KV is being written into decode's blocks
    Success = 4  # KV written and decode told

    @property
    def label(self) -> str:
        """The status as JSON shows it: ``bootstrapping``, ``waiting_for_input``, ``transferring``, ..."""
        return "".join(f"_{c.lower()}" if c.isupper() else c for c in self.name).lstrip("_")


FINAL = frozenset({RoomStatus.Failed, RoomStatus.Success})


def moves(current: RoomStatus, new: RoomStatus) -> bool:
    """Whether a room in ``current`` enters ``new`` when ``new`` is reported: the rule of ``Room.advance``.

    A final status (``Failed``, ``Success``) never changes; from any other, ``Failed`` is entered, and
    any higher status; a lower or equal one is not (racing updates keep the highest).
    """
    if current in FINAL:
        return False
    return new is RoomStatus.Failed or new > current


@dataclass
class Room:
    """State of one room: its status, the time each status was entered, and why it failed.

    Rules of ``advance`` (``moves``):
    - a room moves forward only; advancing to a lower or equal status is ignored (returns False),
      so racing updates can be applied in any order and the highest wins;
    - ``Failed`` and ``Success`` are both final. A failure reported after ``Success`` is refused:
      once the KV sits in decode's blocks and decode was told, the request belongs to decode, and a
      later error (a disconnect) is that request's error, not a failed handover. The first reason
      of failure is kept. A retry is a new room (a new id): a finished room never moves again.

    ``on_change`` (optional) is called with the room after every status it enters, ``Bootstrapping``
    at ``new`` included, after the change is made; it must not raise.
    """

    room: int
    status: RoomStatus = RoomStatus.Bootstrapping
    reason: str | None = None
    times: dict[RoomStatus, float] = field(default_factory=dict)
    on_change: Callable[[Room], None] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def new(cls, room: int, now: float, on_change: Callable[[Room], None] | None = None) -> Room:
        state = cls(room=room, times={RoomStatus.Bootstrapping: now}, on_change=on_change)
        if on_change is not None:
            on_change(state)
        return state

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    @property
    def failed(self) -> bool:
        return self.status is RoomStatus.Failed

    def advance(self, new: RoomStatus, now: float, reason: str | None = None) -> bool:
        """Move to ``new`` if ``moves`` allows it; True when the status changed.

        Moving to ``Failed`` needs a ``reason``; ``reason`` is ignored for any other status.
        """
        if new is RoomStatus.Failed and not reason:
            raise ValueError("a failure needs a reason")
        if not moves(self.status, new):
            return False
        self.status = new
        self.times[new] = now
        if new is RoomStatus.Failed:
            self.reason = reason
        if self.on_change is not None:
            self.on_change(self)
        return True

    def fail(self, reason: str, now: float) -> bool:
        """``advance(Failed, now, reason)``: True when this call failed the room."""
        return self.advance(RoomStatus.Failed, now, reason)


class RoomError(Exception):
    def __init__(self, room: int, message: str) -> None:
        super().__init__(message)
        self.room = room


class DuplicateRoom(RoomError):
    """The same half of a room arrived twice."""


class RoomClosed(RoomError):
    """A half arrived for a room that was already removed (finished, failed, expired or aborted)."""


L = TypeVar("L")
R = TypeVar("R")


@dataclass
class Entry(Generic[L, R]):
    """One room in a ``RoomTable``: its state and the halves that have arrived (with their times)."""

    state: Room
    local: L | None = None
    remote: R | None = None
    local_at: float | None = None
    remote_at: float | None = None

    @property
    def room(self) -> int:
        return self.state.room

    @property
    def paired(self) -> bool:
        """Both halves met: the room entered ``WaitingForInput`` (it may have moved on since)."""
        return RoomStatus.WaitingForInput in self.state.times


class RoomTable(Generic[L, R]):
    """Pairs P's own request for a room (``add_local``) with decode's ``KVRequest`` (``add_remote``).

    Contract for the owner (prefill's server):
    - call ``add_local`` when the router's request arrives and ``add_remote`` when the bootstrap
      server hands over an accepted ``KVRequest``; the call that completes the pair returns the entry
      (status ``WaitingForInput``), the other returns None;
    - the entry stays in the table until the owner calls ``remove`` (done) or ``fail`` (an unpaired
      room failed or aborted); the owner advances ``entry.state`` as a paired room progresses, and
      fails it (``entry.state.fail``) to stop it: its runner sees ``Failed`` at its next safe point;
    - call ``expire`` periodically (e.g. every 0.5 s); it removes and returns rooms still
      ``Bootstrapping`` (unpaired) past the deadline, failed with a reason, and the owner tells
      whichever side did arrive (``send_failed`` to decode, an error to the router);
    - a removed room is remembered (the last ``closed_capacity`` of them): a half that arrives for it
      later raises ``RoomClosed`` with the reason, so the owner can refuse it at once instead of
      holding it until it expires.
    """

    def __init__(self, closed_capacity: int = 65536, on_change: Callable[[Room], None] | None = None) -> None:
        """``on_change``: given to every ``Room`` the table creates (``Room.on_change``)."""
        if closed_capacity <= 0:
            raise ValueError(f"closed_capacity must be > 0, got {closed_capacity}")
        self._entries: dict[int, Entry[L, R]] = {}
        self._closed: OrderedDict[int, str] = OrderedDict()
        self._closed_capacity = closed_capacity
        self._on_change = on_change

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, room: object) -> bool:
        return room in self._entries

    def get(self, room: int) -> Entry[L, R] | None:
        return self._entries.get(room)

    def closed_reason(self, room: int) -> str | None:
        """Why ``room`` was removed, if it was removed recently enough to be remembered."""
        return self._closed.get(room)

    def check_local(self, room: int) -> None:
        """Raise what ``add_local(room, ...)`` would raise now (``RoomClosed``, ``DuplicateRoom``); changes nothing."""
        if room in self._closed:
            raise RoomClosed(room, f"room {room} is closed: {self._closed[room]}")
        entry = self._entries.get(room)
        if entry is not None and entry.local_at is not None:
            raise DuplicateRoom(room, f"room {room}: prefill's own request arrived twice")

    def add_local(self, room: int, item: L, now: float) -> Entry[L, R] | None:
        self.check_local(room)
        entry = self._entry(room, now)
        entry.local, entry.local_at = item, now
        return self._pair_if_complete(entry, now)

    def add_remote(self, room: int, item: R, now: float) -> Entry[L, R] | None:
        entry = self._entry(room, now)
        if entry.remote_at is not None:
            raise DuplicateRoom(room, f"room {room}: decode's KV request arrived twice")
        entry.remote, entry.remote_at = item, now
        return self._pair_if_complete(entry, now)

    def expire(self, now: float, deadline_s: float) -> list[Entry[L, R]]:
        """Remove and return the rooms still ``Bootstrapping`` whose first half arrived ``deadline_s``
        or more ago.

        Each returned entry is ``Failed`` with reason "partner never arrived within N s (...)".
        Paired rooms are never expired here; their deadlines belong to the owner's scheduler.
        """
        expired = []
        for entry in list(self._entries.values()):
            if entry.state.status is not RoomStatus.Bootstrapping:
                continue
            first = entry.local_at if entry.local_at is not None else entry.remote_at
            assert first is not None
            if now - first < deadline_s:
                continue
            missing = "decode's KV request" if entry.remote_at is None else "prefill's own request"
            entry.state.fail(f"partner never arrived within {deadline_s:g} s ({missing} missing)", now)
            self.remove(entry.room)
            expired.append(entry)
        return expired

    def fail(self, room: int, reason: str, now: float) -> Entry[L, R] | None:
        """Fail ``room`` (a room already final keeps its status) and remove it, remembering why: a half
        that arrives later is refused with the room's failure reason. An absent room is closed with
        ``reason``. Returns the removed entry, or None."""
        entry = self._entries.get(room)
        if entry is not None:
            entry.state.fail(reason, now)
        return self.remove(room, reason if entry is None else entry.state.reason or reason)

    def remove(self, room: int, reason: str | None = None) -> Entry[L, R] | None:
        """Remove ``room`` (None if absent) and remember it as closed.

        ``reason`` (e.g. "aborted by decode: client disconnected") is what a late half is told; it
        also closes a room that is not in the table, so a half that has not arrived yet is refused.
        Without it the failure reason of the entry, or "already finished", is remembered.
        """
        entry = self._entries.pop(room, None)
        if entry is not None or reason is not None:
            state_reason = entry.state.reason if entry is not None else None
            self._close(room, reason or state_reason or "already finished")
        return entry

    def _entry(self, room: int, now: float) -> Entry[L, R]:
        if room in self._closed:
            raise RoomClosed(room, f"room {room} is closed: {self._closed[room]}")
        entry = self._entries.get(room)
        if entry is None:
            entry = self._entries[room] = Entry(state=Room.new(room, now, self._on_change))
        return entry

    def _pair_if_complete(self, entry: Entry[L, R], now: float) -> Entry[L, R] | None:
        if entry.local_at is None or entry.remote_at is None:
            return None
        entry.state.advance(RoomStatus.WaitingForInput, now)
        return entry

    def _close(self, room: int, reason: str) -> None:
        self._closed[room] = reason
        self._closed.move_to_end(room)
        while len(self._closed) > self._closed_capacity:
            self._closed.popitem(last=False)
