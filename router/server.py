"""Running the router process: bind, start (discovery; refuse to start if the mode cannot serve),
serve until SIGINT/SIGTERM. On either, the server stops listening, closes idle kept-alive
connections, lets the requests in flight (streams included) finish within ``--shutdown-grace-s``,
cancels what is left, then the router closes; the process exits 0.

The socket is bound first, by the CLI (``cli/router.py``) before anything heavy is imported (so
the port is ours, and a port in use is one line at once) and listens only after startup has
succeeded, so the router answers ``/health`` only once it can route; a signal during startup stops
it (the router closes what it opened) and the process exits 0. The HTTP server is the router's own
(``router.http``: httptools' C parser under an asyncio Protocol; docs/router.md "The server"): it sets
TCP_NODELAY on every accepted connection, and cancels a request's handler when its client leaves,
which is how an abandoned request is aborted in the stages.

The event loop is uvloop's: the router is I/O glue on every request's path (two upstream calls
and one answer per PD request), and uvloop's C loop and transports cut its CPU per request by
about a sixth (17% fewer instructions, measured with callgrind behind ``bench/router_overhead.py``'s
fake stages). The stage servers keep asyncio's loop (``stages/server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvloop

from router.app import create_routes
from router.config import RouterConfig
from router.http import HttpServer
from router.runtime import Router

log = logging.getLogger(__name__)


def serve(config: RouterConfig, sock: socket.socket) -> None:
    """Run the router on ``sock`` (bound to ``--host``/``--port`` by ``process.ports.bind`` before
    this module was imported) until SIGINT/SIGTERM; closes ``sock``. Raises ``StartupError`` if it
    cannot serve."""
    host, port = sock.getsockname()[:2]
    log.info("%s router starting on http://%s:%d", config.mode, host, port)
    try:
        uvloop.run(_run(config, sock))
    finally:
        sock.close()


async def _run(config: RouterConfig, sock: socket.socket) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    router = Router(config)
    if not await _started(router, stop):
        return
    try:
        server = HttpServer(create_routes(router), config.max_body_bytes)
        await server.listen(sock)
        await stop.wait()
        log.info("router stopping: %s s for the requests in flight (--shutdown-grace-s)", f"{config.shutdown_grace_s:g}")
        await server.shutdown(config.shutdown_grace_s)
    finally:
        await router.close()


async def _started(router: Router, stop: asyncio.Event) -> bool:
    """Start ``router``; False if a signal came first (the start is cancelled: it closes what it opened).
    A ``StartupError`` goes on."""
    starting = asyncio.ensure_future(router.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if starting.done():
        starting.result()
        return True
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    return False
