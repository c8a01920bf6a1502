"""ZeroMQ endpoints of the room handshake: prefill's ``BootstrapServer`` and decode's ``BootstrapClient``.

Both run on the asyncio loop of their server (uvicorn / FastAPI) and keep all sockets here; the
pairing logic lives in ``transfer.rooms`` and the wire format in ``transfer.messages``.

One room, seen from the wire (D = decode, P = prefill)::

    D                                         P
    KVRequest{room, blocks, descriptor} --->  check version + fingerprint + blocks
                                        <---  Accepted{room} | Rejected{room, reason}
                                              pair with P's own request, prefill, write KV
                                        <---  KVReady{room, first_token, ...} | KVFailed{room, reason}
    Abort{room, reason}                 --->  (at any time) P stops writing, then answers KVFailed

P binds one ROUTER socket; each D keeps one DEALER socket per P address, shared by all its rooms.
P answers a room to the ZeroMQ identity its ``KVRequest`` came from. Every wait has a deadline.

Block safety: P writes into D's blocks until it has sent its last word for the room (``Rejected``,
``KVReady`` or ``KVFailed``). D must not reuse a room's blocks before that; ``BootstrapClient.abort``
returns True once P's last word has arrived (or P never got the request) and False when it gave up
waiting, in which case D should quarantine the blocks rather than reuse them at once.

Each role has its own module: ``transfer.bootstrap_server`` (P) and ``transfer.bootstrap_client`` (D);
the errors, the frame-size cap and the socket helpers both use live in ``transfer.bootstrap_common``.
This module re-exports the public names, so ``from transfer.bootstrap import ...`` keeps working.
"""

from __future__ import annotations

from transfer.bootstrap_client import BootstrapClient
from transfer.bootstrap_common import MAX_MESSAGE_BYTES, BootstrapClosed, HandshakeError, HandshakeTimeout
from transfer.bootstrap_server import BootstrapServer

__all__ = [
    "MAX_MESSAGE_BYTES",
    "BootstrapClient",
    "BootstrapClosed",
    "BootstrapServer",
    "HandshakeError",
    "HandshakeTimeout",
]
