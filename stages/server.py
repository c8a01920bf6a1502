"""The one way a stage server of any role starts: build the role's app, bind, run uvicorn.

Startup order: the role's ``build`` loads the model (the slow part) before the port is bound, so a
server answers ``/health`` only once it can serve. Each role module exposes
``build(config: ServerConfig) -> FastAPI``; its lifespan starts and stops what the role owns.
"""

from __future__ import annotations

import importlib
import logging
import socket

from stages.config import ServerConfig

log = logging.getLogger(__name__)
BUILDERS = {"colocated": "stages.colocated", "prefill": "stages.disagg.server", "decode": "stages.disagg.server",
            "encoder": "stages.encoder.server", "pd": "stages.disagg.switchable"}


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (port 0: any free port). Made with proto IPPROTO_TCP:
    asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP, and without it each stream on a
    kept-alive connection waits for the client's delayed ACK (~40 ms) and arrives in one burst."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(config: ServerConfig) -> None:
    """Run a ``config.role`` server until SIGINT/SIGTERM."""
    import uvicorn

    log.info("loading %s for the %s role (threads=%d, kv cache %d MiB)", config.engine.model, config.role,
             config.engine.threads, config.engine.kv_cache_mib)
    app = importlib.import_module(BUILDERS[config.role]).build(config)
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5,
                                           access_log=False, loop="asyncio"))  # not uvloop (the router's)
    log.info("%s server for model %r listening on http://%s:%d", config.role, config.model_name, host, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
