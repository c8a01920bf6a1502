"""Serving the routes on a bound socket: ``listen`` starts accepting (one ``Connection`` per client),
``shutdown`` stops: no new connection, idle ones closed, the requests in flight (streams included)
given ``grace_s`` to end, what is left cancelled, every connection closed. The caller owns the
socket (it was bound before, and is closed by whoever bound it) and the event loop.
"""

from __future__ import annotations

import asyncio
import socket

from router.http.connection import Connection
from router.http.routes import Routes

BACKLOG = 128
CANCELLED_S = 5.0  # after the grace: how long cancelled handlers get to end


class HttpServer:
    def __init__(self, routes: Routes, max_body: int) -> None:
        self.routes = routes
        self.max_body = max_body  # the largest request body kept (bytes); more is refused with 413
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None

    async def listen(self, sock: socket.socket) -> None:
        """Listen on ``sock`` (bound, not yet listening) and accept connections from now on."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self.routes, self.max_body, self.connections), sock=sock, backlog=BACKLOG)

    async def shutdown(self, grace_s: float) -> None:
        """Stop listening and end every connection; returns once all are closed or cancelled."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.shut()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _, left = await asyncio.wait(tasks, timeout=grace_s)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=CANCELLED_S)
        for connection in list(self.connections):
            connection.close()
