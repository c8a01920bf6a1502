"""What one stage did for each room, for the router's ``GET /admin/rooms/{room}``: a bounded ring of
the last ``ROOM_HISTORY`` rooms, each a list of events ``{"event", "t", ...fields}`` in the order
they happened (``t``: wall-clock seconds, ``time.time()``), served at ``GET /rooms/{room}``.

Who marks what (docs/admin.md):
    prefill   queued, paired, embeddings_ready (EPD), prefilled, kv_written {bytes, seconds},
              ready_sent; failed {reason}
    decode    queued, blocks_reserved {blocks}, kv_requested, kv_ready, first_token,
              finished {completion_tokens, finish_reason}; failed {reason}
    encoder   queued {images}; per image encoded {key, num_tokens} (at the time its embedding was
              cached), cache_hit {key} or pending_elsewhere {key}; failed {reason}

``mark`` may be called from any thread; it never raises.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from fastapi import FastAPI

from stages.api.errors import APIError

ROOM_HISTORY = 1024


class RoomTimeline:
    def __init__(self, capacity: int = ROOM_HISTORY) -> None:
        self.capacity = capacity
        self._rooms: OrderedDict[int, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def mark(self, room: int, event: str, at: float | None = None, **fields: object) -> None:
        """Record ``event`` for ``room`` now (or at wall-clock ``at``); the oldest room is dropped past
        ``capacity``."""
        entry = {"event": event, "t": time.time() if at is None else at, **fields}
        with self._lock:
            events = self._rooms.get(room)
            if events is None:
                events = self._rooms[room] = []
                while len(self._rooms) > self.capacity:
                    self._rooms.popitem(last=False)
            events.append(entry)

    def events(self, room: int) -> list[dict] | None:
        with self._lock:
            events = self._rooms.get(room)
            return None if events is None else list(events)


def add_room_route(app: FastAPI, timeline: RoomTimeline, role: str) -> None:
    """``GET /rooms/{room}``: ``{"room", "role", "events"}``, or 404 ``room_not_found``."""

    @app.get("/rooms/{room}", include_in_schema=False)
    async def room_events(room: int) -> dict:
        events = timeline.events(room)
        if events is None:
            raise APIError(404, f"room {room} is not among the last {timeline.capacity} rooms this {role} kept",
                           param="room", code="room_not_found")
        return {"room": room, "role": role, "events": events}
