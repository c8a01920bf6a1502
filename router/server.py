"""Running the router process: bind, start (discovery; refuse to start if the mode cannot serve),
serve until SIGINT/SIGTERM. On either, aiohttp stops listening, lets the requests in flight (streams
included) finish within ``--shutdown-grace-s``, cancels what is left, then the router closes; the
process exits 0.

The socket is bound first, by the CLI (``stages/cli/router.py``) before anything heavy is imported (so the port is ours,
and a port in use is one line at once) and listens only after startup has succeeded, so
the router answers ``/health`` only once it can route. aiohttp serves with its C HTTP parser, sets
TCP_NODELAY on every accepted connection, and cancels a request's handler when its client leaves
(``handler_cancellation``), which is how an abandoned request is aborted in the stages.

The event loop is uvloop's: the router is I/O glue on every request's path (two upstream calls
and one answer per PD request), and uvloop's C loop and transports cut its CPU per request by
about a sixth (17% fewer instructions, measured with callgrind behind ``bench/router_overhead.py``'s
fake stages). The stage servers keep asyncio's loop (``stages/server.py``).
"""

from __future__ import annotations

import logging
import socket

import uvloop
from aiohttp import web

from router.app import create_app
from router.config import RouterConfig
from router.runtime import Router

log = logging.getLogger(__name__)


def serve(config: RouterConfig, sock: socket.socket) -> None:
    """Run the router on ``sock`` (bound to ``--host``/``--port`` by ``stages.launch.ports.bind`` before
    this module was imported) until SIGINT/SIGTERM. Raises ``StartupError`` if it cannot serve."""
    host, port = sock.getsockname()[:2]
    log.info("%s router starting on http://%s:%d", config.mode, host, port)
    try:
        web.run_app(create_app(Router(config)), loop=uvloop.new_event_loop(), sock=sock, handler_cancellation=True,
                    print=None, access_log=None, shutdown_timeout=config.shutdown_grace_s)
    finally:
        sock.close()
