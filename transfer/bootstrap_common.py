"""Shared by both ends of the room handshake: its errors, the frame-size cap and the socket helpers.

``transfer.bootstrap_server`` (prefill) and ``transfer.bootstrap_client`` (decode) import from here;
``transfer.bootstrap`` re-exports the public names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # a KVRequest for a 1M-token prompt in 16-token blocks is ~0.6 MiB


class HandshakeError(Exception):
    """D's handshake for ``room`` failed; ``reason`` says why and, where it can, what to change."""

    def __init__(self, room: int | None, reason: str) -> None:
        super().__init__(reason)
        self.room = room
        self.reason = reason


class HandshakeTimeout(HandshakeError):
    """A deadline passed before P answered."""


class PeerNotAllowed(HandshakeError):
    """A request named a prefill address that ``--allowed-bootstrap`` (or the router) did not allow;
    nothing was dialed. Decode's server answers 403."""


class BootstrapClosed(ConnectionError):
    """``BootstrapServer.recv`` on a closed server."""


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _socket(ctx: zmq.asyncio.Context, kind: int, host: str, max_message_bytes: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


async def _receive(sock: zmq.asyncio.Socket, closed: Callable[[], bool], where: str) -> list[bytes] | None:
    """The next multipart message, or None once the socket is closed; other errors are logged and retried."""
    while True:
        try:
            return await sock.recv_multipart()
        except zmq.ZMQError as e:
            if closed() or e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                return None
            log.warning("%s: receive failed: %s", where, e)
            await asyncio.sleep(0.01)
