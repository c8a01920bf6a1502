"""The router's side of room timelines (``GET /admin/rooms``). Pure: the dispatcher writes, the admin
API reads.

One ``RoomRecord`` per room the router drew (each attempt of a request is a room of its own): when
the request was received, when the room was dispatched to its stages, when the client got the
first byte, when it was done, how it ended, and which worker served each stage. ``RoomLog`` keeps
the last ``--room-history`` of them; the stages keep their own per-room events, which the admin API
fetches and merges (``router.admin.rooms``). Times are wall-clock seconds (``time.time()``), so
events from different machines line up as far as their clocks agree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class _Worker(Protocol):
    id: str
    url: str


def stage_workers(targets: Iterable[tuple[str, _Worker]]) -> dict[str, dict]:
    """``{stage: {"id", "url"}}`` of a plan's (stage, worker) targets; a stage with several workers
    (a room's images spread over encoders) is keyed ``encoder``, ``encoder2``, ..."""
    found: dict[str, dict] = {}
    for stage, worker in targets:
        key, n = stage, 1
        while key in found:
            n += 1
            key = f"{stage}{n}"
        found[key] = {"id": worker.id, "url": worker.url}
    return found


@dataclass(slots=True)
class RoomRecord:
    """Written once per attempt on the request path, so it holds the plan's (stage, worker) pairs as
    they are; ``workers`` is made from them when the admin API reads it."""

    room: int
    received: float
    dispatched: float
    stream: bool
    targets: tuple[tuple[str, _Worker], ...] = ()  # the plan's (stage, worker) pairs, answering stage first
    first_byte: float | None = None
    done: float | None = None
    outcome: str | None = None  # success, aborted (client left), failed: <why>

    @property
    def workers(self) -> dict[str, dict]:
        """stage -> {"id", "url"} (``stage_workers``)."""
        return stage_workers(self.targets)

    @property
    def seconds(self) -> float | None:
        return None if self.done is None else self.done - self.received

    def events(self) -> list[dict]:
        marks = [("received", self.received), ("dispatched", self.dispatched), ("first_byte", self.first_byte),
                 ("done", self.done)]
        return [{"event": name, "t": t} for name, t in marks if t is not None]

    def to_json(self) -> dict:
        return {"room": self.room, "stream": self.stream, "outcome": self.outcome, "seconds": self.seconds,
                "workers": self.workers, "events": self.events()}


class RoomLog:
    """The last ``capacity`` rooms, oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rooms: OrderedDict[int, RoomRecord] = OrderedDict()

    def open(self, record: RoomRecord) -> RoomRecord:
        self._rooms[record.room] = record
        self._rooms.move_to_end(record.room)
        while len(self._rooms) > self.capacity:
            self._rooms.popitem(last=False)
        return record

    def get(self, room: int) -> RoomRecord | None:
        return self._rooms.get(room)

    def slowest(self, n: int) -> list[RoomRecord]:
        """The ``n`` finished rooms that took longest, slowest first."""
        done = [r for r in self._rooms.values() if r.seconds is not None]
        return sorted(done, key=lambda r: r.seconds or 0.0, reverse=True)[:n]

    def __len__(self) -> int:
        return len(self._rooms)
