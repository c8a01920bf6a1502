"""The points in a room's life where something may be plugged in: ``PrefillHooks`` (called by
``PrefillCoordinator``) and ``DecodeHooks`` (``DecodeCoordinator``). The coordinators call every hook
unconditionally, on the event loop, each time the place its name says is reached; these defaults do
nothing. A server started with ``--debug-faults`` plugs in its fault points instead
(``stages.faults.rooms``). A hook may raise (the room fails with that exception, as with any
unexpected one there) or end the process; it must not block the event loop.
"""

from __future__ import annotations


class PrefillHooks:
    def received(self) -> None:
        """A message came to the bootstrap receive loop, before it is handled (raising ends the loop)."""

    def before_forward(self, room: int) -> None:
        """A room with its inputs ready, before its forward pass (from its HTTP half's arrival, paired or not)."""

    def after_forward(self, room: int) -> None:
        """A room prefilled (it holds its blocks), before its KV write."""

    async def before_ready(self, room: int) -> None:
        """A room's KV written into the decode's blocks, before ``KVReady`` is sent."""


class DecodeHooks:
    def before_kv_request(self, room: int) -> None:
        """A room's blocks reserved, before its ``KVRequest`` is sent to the prefill."""
