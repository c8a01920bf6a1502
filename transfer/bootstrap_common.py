"""Shared by both ends of the room handshake: its errors, the frame-size cap and the socket helpers.

``transfer.bootstrap_server`` (prefill) and ``transfer.bootstrap_client`` (decode) import from here;
``transfer.bootstrap`` re-exports the public names.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

MAX_MESSAGE_BYTES = 16 << 20  # a KVRequest for a 1M-token prompt in 16-token blocks is ~0.6 MiB


class HandshakeError(Exception):
    """D's handshake for ``room`` failed; ``reason`` says why and, where it can, what to change."""

    def __init__(self, room: int | None, reason: str) -> None:
        super().__init__(reason)
        self.room = room
        self.reason = reason


class HandshakeTimeout(HandshakeError):
    """A deadline passed before P answered."""


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
