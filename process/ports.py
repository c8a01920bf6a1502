"""Ports: taking a server's port before anything slow happens (imports, model loading, discovery), so
a port in use is answered at once in one line that names the flag to change; and a free loopback port
for a child to be started on. Standard library only.

The CLI binds (``stage serve ROLE`` and ``stage serve router`` alike) and hands the socket to the
server, which listens on it only once it can serve; ``stage up`` probes its ``--port`` before it starts
anything.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

from process.addresses import host_port


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_FREE_PORT_LOW = 10000  # above the ports services are usually configured on
_FREE_PORT_TRIES = 64
_RANDOM = random.SystemRandom()  # not the shared generator, which a test or a benchmark may have seeded


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
    port a library or a child binds later (e.g. the prefill's bootstrap endpoint, ``stage up --port``)."""
    bind(host, port, flag).close()


def refusal(host: str, port: int, flag: str, exc: OSError) -> str:
    """The one line a failed bind of ``host:port`` is answered with (pure)."""
    if exc.errno == errno.EADDRINUSE:
        return (f"{flag} {port}: {host_port(host, port)} is already in use by another process; stop it or give another "
                f"{flag} (0: any free port)")
    return f"cannot listen on {host_port(host, port)} (--host {host}, {flag} {port}): {exc.strerror or exc}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that was free a moment ago, for a child to bind (it may be taken in between:
    callers that start a child on it retry or report the child's bind error).

    Drawn at random below the kernel's ephemeral range (``ephemeral_ports``), not by binding port 0:
    a port 0 bind returns an ephemeral port, and every other process's outgoing connection or port 0
    listener (a ZeroMQ bind, a transfer engine, a Redis client) draws from that same range, so it
    could take the port in the moment before the child binds it."""
    low, _ = ephemeral_ports()
    for _ in range(_FREE_PORT_TRIES if low - _FREE_PORT_LOW >= 1000 else 0):
        port = _RANDOM.randrange(_FREE_PORT_LOW, low)
        with socket.socket() as sock:  # no SO_REUSEADDR: a port bound and not yet listening is not free
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the ephemeral range, or it is crowded: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port 0 binds and outgoing connections, ``(low, high)`` inclusive: Linux's
    ``ip_local_port_range``, else IANA's 49152-65535."""
    try:
        low, high = Path(_EPHEMERAL_RANGE).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535
