"""The body fields the router adds to a client's request in pd and epd modes, and no client sends. Pure.

The router picks a prefill and a decode for each request and a room number for it, and writes them
into both bodies as ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` (any a client sent
are dropped first). A prefill serves the room's KV at that address; a decode dials it there. A stage
refuses a disaggregated request without all three (400 naming the missing one); the router's
``/openapi.json`` leaves them out of what a client may send (``router.openapi``).
"""

from __future__ import annotations

from typing import Final

BOOTSTRAP_HOST: Final = "bootstrap_host"  # the prefill's bootstrap host (its --bootstrap-host or its address)
BOOTSTRAP_PORT: Final = "bootstrap_port"  # the prefill's --bootstrap-port
BOOTSTRAP_ROOM: Final = "bootstrap_room"  # the request's room: 0 .. ROOM_MAX, unique among those in flight
BOOTSTRAP_FIELDS: Final = (BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM)
ROOM_MAX: Final = (1 << 63) - 1  # a room is a signed 64-bit integer >= 0 on every wire that carries it
