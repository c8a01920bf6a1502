"""The one way a stage server of any role starts: take its ports, build the role's app, run uvicorn.

Startup order: ``claim_ports`` binds the HTTP socket (and probes a fixed ``--bootstrap-port``) before
anything slow, so a port in use is answered at once and nothing can take the port while the model
loads; then the role's ``build`` loads the model (the slow part), and only then does the socket
listen, so a server answers ``/health`` only once it can serve. Each role module exposes
``build(config: ServerConfig) -> FastAPI``; its lifespan starts and stops what the role owns.

Shutdown: SIGTERM drains (``stages.drain``, ``stages.api.drain_gate``): new work is refused with 503
``draining`` and ``/health`` answers 503 ``{"status": "draining"}`` while the requests in flight
finish, within ``--shutdown-grace-s`` (past it they are aborted with an error); only then does uvicorn
stop listening and the lifespan stop what the role owns (a prefill's bootstrap endpoint stays up
until its rooms have ended), and the process exits 0. SIGINT (Ctrl-C) stops at once, as uvicorn
does, giving the requests in flight ``--shutdown-grace-s`` to end.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import signal
import socket
from types import FrameType

import uvicorn

from stages.config import ServerConfig
from stages.drain import Drain
from process.ports import bind, probe
from process.addresses import host_port

log = logging.getLogger(__name__)
BUILDERS = {"colocated": "stages.colocated", "prefill": "stages.disagg.server", "decode": "stages.disagg.server",
            "encoder": "stages.encoder.server", "pd": "stages.disagg.switchable"}


def claim_ports(config: ServerConfig) -> socket.socket:
    """The server's HTTP socket, bound to ``--host``/``--port``, after checking that a fixed bootstrap
    port (prefill, pd: ``--bootstrap-port`` other than 0) is free. ``process.ports.PortError`` (a
    ValueError) names the port and its flag."""
    disagg = config.disagg
    if disagg is not None and config.role in ("prefill", "pd") and disagg.bootstrap_port:
        probe(disagg.bootstrap_host, disagg.bootstrap_port, "--bootstrap-port")
    return bind(config.host, config.port)


def serve(config: ServerConfig, sock: socket.socket) -> None:
    """Run a ``config.role`` server on ``sock`` (from ``claim_ports``) until SIGTERM (drained first)
    or SIGINT."""
    from stages.api.drain_gate import DrainGate

    log.info("loading %s for the %s role (threads=%d, --kv-cache-mib %s)", config.engine.model, config.role,
             config.engine.threads, config.engine.kv_cache_mib)
    app = importlib.import_module(BUILDERS[config.role]).build(config)
    drain = Drain(config.shutdown_grace_s)
    app.add_middleware(DrainGate, drain=drain, stage=config.role if config.role != "pd" else None)
    if config.tracing.enabled:  # off: nothing installed (stages.tracing)
        from stages.tracing import install
        install(app, config.tracing)
    host, port = sock.getsockname()[:2]
    server = _DrainingServer(uvicorn.Config(app, log_level=config.log_level, access_log=False,
                                            loop="asyncio",  # not uvloop (the router's)
                                            timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s)), drain)
    log.info("%s server for model %r listening on http://%s", config.role, config.model_name, host_port(host, port))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains (``Drain.run``) before uvicorn's own shutdown, and is not
    raised again once it is done (uvicorn re-raises the signals it caught: the process would end by
    SIGTERM, not with exit code 0)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if not self.drain.draining:  # a second SIGTERM changes nothing: the grace bounds the wait
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is not None:
            return
        self.drain.begin()  # at once: the next request is refused
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.drain.run()
        self.should_exit = True
