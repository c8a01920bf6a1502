"""asyncio's write flow control, shared by the router's two connection protocols (to its clients,
``router.http.connection``; to its stages, ``router.upstream.connection``): the transport calls
``pause_writing`` when its buffer passes the high-water mark and ``resume_writing`` when it drains;
a writer awaits ``writable`` before the next piece. The protocol calls ``release_writer`` when its
connection is lost, so no writer waits forever."""

from __future__ import annotations

import asyncio


class WriteFlow:
    loop: asyncio.AbstractEventLoop

    def __init__(self) -> None:
        self.write_paused = False
        self.drained: asyncio.Future | None = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.release_writer()

    def release_writer(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    async def writable(self) -> None:
        """Until the transport takes more (at once unless paused), or the connection was lost."""
        if self.write_paused:
            self.drained = self.loop.create_future()
            await self.drained
