"""Prefill's end of the room handshake: ``BootstrapServer`` (see ``transfer.bootstrap_common`` for the wire)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from process.addresses import host_port
from transfer.bootstrap_common import MAX_MESSAGE_BYTES, BootstrapClosed, _endpoint, _receive, _socket
from transfer.fingerprint import Fingerprint, check_version
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    Heartbeat,
    KVFailed,
    KVReady,
    KVRequest,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Rejected,
    VersionMismatch,
    check_kv_request,
    decode,
    encode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Peer:
    identity: bytes
    decode_id: str


class BootstrapServer:
    """P's endpoint: receives decode's ``KVRequest``/``Abort``, answers, and routes results back.

    Contract for the owner (prefill's server):
    - ``await start()`` once (binds ``host:port``; port 0 picks a free one, see ``port``), then loop
      on ``await recv()``, which yields each *accepted* ``KVRequest`` and each ``Abort`` for a room
      this server holds. Requests that fail validation never reach the owner; D gets ``Rejected``.
    - For every ``KVRequest`` it received, the owner calls exactly one of ``send_ready`` or
      ``send_failed``, after which the server forgets the room. On ``Abort`` the owner stops work on
      the room and, once no write into D's blocks can still land, calls ``send_failed`` (D waits for
      it before reusing the blocks).
    - ``await close()`` on shutdown; ``recv`` then raises ``BootstrapClosed``.
    - ``serve_task`` (after ``start``) is the one task that reads the socket. It ends only after
      ``close()``; an end before that (an error it could not survive) is a death the owner should
      report (e.g. hand it to its supervisor): from then on nothing reaches ``recv``.
    Garbage frames are logged and dropped (``bad_frames`` counts them); the server keeps serving.

    Liveness: every ``heartbeat_s`` the server sends each decode that has rooms here one
    ``Heartbeat`` naming them (a task of its own, started by ``start``), whatever the owner is doing
    with them, so a decode can tell a slow prefill (heartbeats come) from a vanished one (silence).
    """

    def __init__(
        self,
        fingerprint: Fingerprint,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_rooms: int = 4096,
        send_timeout_s: float = 5.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        heartbeat_s: float = 1.0,
    ) -> None:
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.fingerprint = fingerprint
        self.host = host
        self.port = port
        self.max_rooms = max_rooms
        self.send_timeout_s = send_timeout_s
        self.max_message_bytes = max_message_bytes
        self.heartbeat_s = heartbeat_s
        self.heartbeats_sent = 0
        self.bad_frames = 0
        self._peers: dict[int, _Peer] = {}
        self._events: asyncio.Queue[KVRequest | Abort | None] = asyncio.Queue()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    @property
    def rooms(self) -> frozenset[int]:
        """Rooms accepted and not yet answered with ``send_ready``/``send_failed``."""
        return frozenset(self._peers)

    @property
    def serve_task(self) -> asyncio.Task[None] | None:
        """The task reading the socket, once started (see the class contract)."""
        return self._task

    async def start(self) -> None:
        if self._ctx is not None:
            raise RuntimeError(f"bootstrap server {self.address} already started")
        self._ctx = zmq.asyncio.Context()
        self._sock = _socket(self._ctx, zmq.ROUTER, self.host, self.max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone D raises instead of vanishing
        self._sock.bind(_endpoint(self.host, self.port or "*"))
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._task = asyncio.create_task(self._serve(), name=f"bootstrap-server-{self.port}")
        self._beat = asyncio.create_task(self._heartbeats(), name=f"bootstrap-heartbeat-{self.port}")
        log.info("bootstrap server listening on %s", self.address)

    async def __aenter__(self) -> BootstrapServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def recv(self) -> KVRequest | Abort:
        """The next accepted ``KVRequest`` or ``Abort``; raises ``BootstrapClosed`` after ``close``."""
        if not self._closed:
            event = await self._events.get()
            if event is not None:
                return event
            self._events.put_nowait(None)  # wake the next waiter too
        raise BootstrapClosed(f"bootstrap server {self.address} is closed")

    async def send_ready(self, ready: KVReady) -> bool:
        """Tell D its KV for ``ready.room`` is in place. False if D is gone or the room is unknown."""
        return await self._answer(ready.room, ready)

    async def send_failed(self, room: int, reason: str, *, code: str | None = None,
                          image_key: str | None = None) -> bool:
        """Tell D that ``room`` failed (or acknowledge its ``Abort``). False if D is gone or unknown.
        ``code`` and ``image_key``: the failure's typed fields (``KVFailed``), as P answers its own
        client; None when it has none."""
        return await self._answer(room, KVFailed(room=room, reason=reason, code=code, image_key=image_key))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [task for task in (self._task, self._beat) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._peers.clear()
        self._events.put_nowait(None)

    async def _answer(self, room: int, msg: KVReady | KVFailed) -> bool:
        peer = self._peers.pop(room, None)
        if peer is None:
            log.debug("room %d: no decode waiting (aborted, answered, or never requested)", room)
            return False
        return await self._send(peer.identity, msg)

    async def _send(self, identity: bytes, msg: Message) -> bool:
        assert self._sock is not None
        frame = encode(msgspec.structs.replace(msg, sent_at=time.time()))
        try:
            await asyncio.wait_for(self._sock.send_multipart([identity, frame]), self.send_timeout_s)
            return True
        except zmq.ZMQError as e:
            log.warning("bootstrap %s: cannot send %s to decode: %s", self.address, type(msg).__name__, e)
        except TimeoutError:
            log.warning("bootstrap %s: sending %s timed out", self.address, type(msg).__name__)
        return False

    async def _heartbeats(self) -> None:
        """Every ``heartbeat_s``: one ``Heartbeat`` to each decode holding rooms here. Each send is
        its own task, and a decode whose last beat is still being sent (gone, stopped: up to
        ``send_timeout_s``) is skipped, so it never delays the other decodes' beats."""
        sending: dict[bytes, asyncio.Task[bool]] = {}
        try:
            while True:
                await asyncio.sleep(self.heartbeat_s)
                held: dict[bytes, list[int]] = {}
                for room, peer in self._peers.items():
                    held.setdefault(peer.identity, []).append(room)
                for identity, rooms in held.items():
                    if identity in sending:
                        continue
                    task = asyncio.create_task(self._send(identity, Heartbeat(rooms=rooms)))
                    sending[identity] = task
                    task.add_done_callback(functools.partial(_forget_send, sending, identity))
                    self.heartbeats_sent += 1
        finally:
            for task in list(sending.values()):
                task.cancel()

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await _receive(self._sock, lambda: self._closed, f"bootstrap {self.address}")
            if frames is None:
                return
            try:
                await self._handle(frames)
            except Exception:  # one bad frame must never stop the endpoint
                log.exception("bootstrap %s: error while handling a frame", self.address)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return self._bad(f"expected [identity, message], got {len(frames)} frames")
        identity, data = frames
        try:
            msg = decode(data)
        except VersionMismatch as e:
            reason = check_version(PROTOCOL_VERSION, e.peer_version)
            assert reason is not None
            if e.room is not None:
                await self._send(identity, Rejected(room=e.room, reason=reason))
            return self._bad(reason)
        except ProtocolError as e:
            return self._bad(str(e))
        if isinstance(msg, KVRequest):
            await self._on_request(identity, msg)
        elif isinstance(msg, Abort):
            await self._on_abort(identity, msg)
        elif isinstance(msg, Ping):
            await self._send(identity, Pong(nonce=msg.nonce, fingerprint=self.fingerprint))
        else:
            self._bad(f"unexpected {type(msg).__name__} (a message for decode)")

    async def _on_request(self, identity: bytes, req: KVRequest) -> None:
        reason = check_kv_request(req, self.fingerprint)
        if reason is None and req.room in self._peers:
            reason = f"room {req.room} is already in flight on this prefill"
        if reason is None and len(self._peers) >= self.max_rooms:
            reason = f"prefill {self.address} is full ({self.max_rooms} rooms in flight)"
        if reason is not None:
            log.warning("bootstrap %s: rejected room %d from %s: %s", self.address, req.room, req.decode_id, reason)
            await self._send(identity, Rejected(room=req.room, reason=reason))
            return
        self._peers[req.room] = _Peer(identity, req.decode_id)
        if await self._send(identity, Accepted(room=req.room)):
            self._events.put_nowait(req)
        else:
            self._peers.pop(req.room, None)

    async def _on_abort(self, identity: bytes, msg: Abort) -> None:
        peer = self._peers.get(msg.room)
        if peer is None:  # nothing in flight here: settle D at once
            await self._send(identity, KVFailed(room=msg.room, reason=f"prefill has no room {msg.room} in flight"))
        elif peer.identity != identity:
            self._bad(f"abort of room {msg.room} from a decode that does not own it")
        else:
            self._events.put_nowait(msg)

    def _bad(self, why: str) -> None:
        self.bad_frames += 1
        level = logging.WARNING if self.bad_frames <= 10 else logging.DEBUG
        log.log(level, "bootstrap %s: dropped a frame (%d so far): %s", self.address, self.bad_frames, why)


def _forget_send(sending: dict[bytes, asyncio.Task[bool]], identity: bytes, _: asyncio.Task[bool]) -> None:
    sending.pop(identity, None)
