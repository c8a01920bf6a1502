"""The room handshake between a decode (D) and a prefill (P) over ZeroMQ, and what both ends share:
its errors, the frame-size cap and the socket helpers. The ends: ``transfer.bootstrap_server.BootstrapServer``
(prefill) and ``transfer.bootstrap_client.BootstrapClient`` (decode, with its link cache in
``transfer.peer_links``).

Both run on the asyncio loop of their server (uvicorn / FastAPI) and keep all their sockets in these modules; the
pairing logic lives in ``transfer.rooms`` and the wire format in ``transfer.messages``.

One room, seen from the wire (D = decode, P = prefill)::

    D                                         P
    KVRequest{room, blocks, descriptor} --->  check version + fingerprint + blocks
                                        <---  Accepted{room} | Rejected{room, reason}
                                              pair with P's own request, prefill, write KV
                                        <---  KVReady{room, first_token, ...} | KVFailed{room, reason}
    Abort{room, reason}                 --->  (at any time) P stops writing, then answers KVFailed
                                        <---  Heartbeat{rooms} every heartbeat_s while P holds rooms
                                              of this D (D fails a room silent for its idle bound)

P binds one ROUTER socket; each D keeps one DEALER socket per P address, shared by all its rooms.
P answers a room to the ZeroMQ identity its ``KVRequest`` came from. Every wait has a deadline.

Block safety: P writes into D's blocks until it has sent its last word for the room (``Rejected``,
``KVReady`` or ``KVFailed``). D must not reuse a room's blocks before that; ``BootstrapClient.abort``
returns True once P's last word has arrived (or P never got the request) and False when it gave up
waiting, in which case D should quarantine the blocks rather than reuse them at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from process.addresses import host_port

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
    return f"tcp://{host_port(host, port)}"


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
