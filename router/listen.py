"""Taking a server's ports before anything slow happens (imports, model loading, discovery), so a
port in use is answered at once in one line that names the flag to change. Standard library only:
the router and every stage server use it (the router imports nothing of ``stages``)."""

from __future__ import annotations

import errno
import socket


class PortError(ValueError):
    """A port could not be taken; the message names the address, the port and the flag to change."""


def bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port), not yet listening; the server
    listens on it once it can serve. ``PortError`` names ``flag`` (and ``--host`` when the address is
    the problem). Made with proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets whose
    proto says TCP, and without it each stream on a kept-alive connection waits for the client's
    delayed ACK (~40 ms) and arrives in one burst."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortError(refusal(host, port, flag, exc)) from None
    return sock


def probe(host: str, port: int, flag: str) -> None:
    """Raise ``PortError`` if ``host:port`` cannot be bound now (another process listens there), for a
    port a library binds later (e.g. the prefill's bootstrap endpoint)."""
    bind(host, port, flag).close()


def refusal(host: str, port: int, flag: str, exc: OSError) -> str:
    """The one line a failed bind of ``host:port`` is answered with (pure)."""
    if exc.errno == errno.EADDRINUSE:
        return (f"{flag} {port}: {host}:{port} is already in use by another process; stop it or give another "
                f"{flag} (0: any free port)")
    return f"cannot listen on {host}:{port} (--host {host}, {flag} {port}): {exc.strerror or exc}"
