"""What one stage did for each room, for the router's ``GET /admin/rooms/{room}``: a bounded ring of
the last ``ROOM_HISTORY`` rooms, each a list of events ``{"event", "t", ...fields}`` in the order
they happened (``t``: wall-clock seconds, ``time.time()``) and, on a prefill or decode, the room's
handover status, served at ``GET /rooms/{room}``.

The status and the events that are status changes are not marked by hand: they follow the room's
state (``transfer.rooms.Room``) through the listener ``follow`` gives, so they cannot disagree with
it. Events (docs/admin.md; * = a status change):
    prefill   queued, paired*, embeddings_ready (EPD), prefilled (then transferring*, unnamed),
              kv_written {bytes, seconds}, ready_sent* (success); failed* {reason}
    decode    queued, blocks_reserved {blocks}, kv_requested* (the prefill accepted), kv_ready*
              (success), first_token, finished {completion_tokens, finish_reason}; failed* {reason}
    encoder   queued {images}; per video decoded here video_decoded {key, frames, seconds}; per
              vision-tower call that encoded images of the room batch {since, keys, batch_images} (since:
              the call's start, t: its end; keys: the room's images in it, batch_images: all it took);
              per image (or video) encoded {key, num_tokens[, frames]} (at the time its embedding was
              cached), cache_hit {key} or pending_elsewhere {key}; failed {reason} (no status)

A room's events become its OpenTelemetry spans when it ends (``stages.tracing``,
``telemetry.timeline_spans``): an event with ``since`` is a span of its own.

``mark`` and the listener may be called from any thread; they never raise.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI

from contract.errors import Code
from stages.api.errors import APIError
from transfer.rooms import Room, RoomStatus

ROOM_HISTORY = 1024
FAILED = "failed"  # the event that ends a failed room (``follow``'s for RoomStatus.Failed, an encoder's)


@dataclass
class _Kept:
    events: list[dict] = field(default_factory=list)
    status: RoomStatus | None = None  # the last status the room's state entered (``follow``)


class RoomTimeline:
    def __init__(self, capacity: int = ROOM_HISTORY) -> None:
        self.capacity = capacity
        self._rooms: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def mark(self, room: int, event: str, at: float | None = None, **fields: object) -> None:
        """Record ``event`` for ``room`` now (or at wall-clock ``at``); the oldest room is dropped past
        ``capacity``."""
        entry = {"event": event, "t": time.time() if at is None else at, **fields}
        with self._lock:
            self._kept(room).events.append(entry)

    def follow(self, events: Mapping[RoomStatus, str]) -> Callable[[Room], None]:
        """A ``Room.on_change`` listener: keeps each status the room enters as the room's status here,
        and marks it as the event ``events`` names (``failed`` with the room's ``reason``), if any."""

        def changed(state: Room) -> None:
            name = events.get(state.status)
            entry = None if name is None else {"event": name, "t": time.time()}
            if entry is not None and state.status is RoomStatus.Failed:
                entry["reason"] = state.reason
            with self._lock:
                kept = self._kept(state.room)
                kept.status = state.status
                if entry is not None:
                    kept.events.append(entry)

        return changed

    def events(self, room: int) -> list[dict] | None:
        with self._lock:
            kept = self._rooms.get(room)
            return None if kept is None else list(kept.events)

    def snapshot(self, room: int) -> tuple[list[dict], RoomStatus | None] | None:
        """The room's events and the status its state last entered (None for a room without a state),
        read together; None for a room not kept."""
        with self._lock:
            kept = self._rooms.get(room)
            return None if kept is None else (list(kept.events), kept.status)

    def _kept(self, room: int) -> _Kept:
        """The room's record (under the lock), made if new; the oldest room is dropped past ``capacity``."""
        kept = self._rooms.get(room)
        if kept is None:
            kept = self._rooms[room] = _Kept()
            while len(self._rooms) > self.capacity:
                self._rooms.popitem(last=False)
        return kept


def add_room_route(app: FastAPI, timeline: RoomTimeline, role: str, encoder: RoomTimeline | None = None) -> None:
    """``GET /rooms/{room}``: ``{"room", "role", "status", "events"}`` (``status``: the handover status
    the room's state last entered, ``RoomStatus.label``; null where the stage keeps none), or 404
    ``room_not_found``. ``encoder``: a switchable worker's encode events, kept apart from its role's and
    served for ``?stage=encoder`` (which the router asks of every worker that encoded for a room)."""

    @app.get("/rooms/{room}", include_in_schema=False)
    async def room_events(room: int, stage: str | None = None) -> dict:
        kept = (encoder if stage == "encoder" and encoder is not None else timeline).snapshot(room)
        if kept is None:
            raise APIError(404, f"room {room} is not among the last {timeline.capacity} rooms this {role} kept",
                           param="room", code=Code.ROOM_NOT_FOUND)
        events, status = kept
        return {"room": room, "role": role, "status": None if status is None else status.label, "events": events}
