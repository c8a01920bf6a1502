"""The one way a stage server of any role starts: take its ports, build the role's app, run uvicorn.

Startup order: ``claim_ports`` binds the HTTP socket (and probes a fixed ``--bootstrap-port``) before
anything slow, so a port in use is answered at once and nothing can take the port while the model
loads; then the role's ``build`` loads the model (the slow part), and only then does the socket
listen, so a server answers ``/health`` only once it can serve. Each role module exposes
``build(config: ServerConfig) -> FastAPI``; its lifespan starts and stops what the role owns.
"""

from __future__ import annotations

import importlib
import logging
import socket

from stages.launch.ports import bind, probe
from stages.config import ServerConfig
from transfer.addresses import host_port

log = logging.getLogger(__name__)
BUILDERS = {"colocated": "stages.colocated", "prefill": "stages.disagg.server", "decode": "stages.disagg.server",
            "encoder": "stages.encoder.server", "pd": "stages.disagg.switchable"}


def claim_ports(config: ServerConfig) -> socket.socket:
    """The server's HTTP socket, bound to ``--host``/``--port``, after checking that a fixed bootstrap
    port (prefill, pd: ``--bootstrap-port`` other than 0) is free. ``stages.launch.ports.PortError`` (a
    ValueError) names the port and its flag."""
    disagg = config.disagg
    if disagg is not None and config.role in ("prefill", "pd") and disagg.bootstrap_port:
        probe(disagg.bootstrap_host, disagg.bootstrap_port, "--bootstrap-port")
    return bind(config.host, config.port)


def serve(config: ServerConfig, sock: socket.socket) -> None:
    """Run a ``config.role`` server on ``sock`` (from ``claim_ports``) until SIGINT/SIGTERM."""
    import uvicorn

    log.info("loading %s for the %s role (threads=%d, kv cache %d MiB)", config.engine.model, config.role,
             config.engine.threads, config.engine.kv_cache_mib)
    app = importlib.import_module(BUILDERS[config.role]).build(config)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5,
                                           access_log=False, loop="asyncio"))  # not uvloop (the router's)
    log.info("%s server for model %r listening on http://%s", config.role, config.model_name, host_port(host, port))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
