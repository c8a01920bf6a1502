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
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    Fingerprint,
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
    check_version,
    decode,
    encode,
)
from transfer.rooms import Room, RoomStatus

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


# ---------------------------------------------------------------------------------------------------
# Prefill side


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
    Garbage frames are logged and dropped (``bad_frames`` counts them); the server keeps serving.
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
    ) -> None:
        self.fingerprint = fingerprint
        self.host = host
        self.port = port
        self.max_rooms = max_rooms
        self.send_timeout_s = send_timeout_s
        self.max_message_bytes = max_message_bytes
        self.bad_frames = 0
        self._peers: dict[int, _Peer] = {}
        self._events: asyncio.Queue[KVRequest | Abort | None] = asyncio.Queue()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def rooms(self) -> frozenset[int]:
        """Rooms accepted and not yet answered with ``send_ready``/``send_failed``."""
        return frozenset(self._peers)

    async def start(self) -> None:
        if self._ctx is not None:
            raise RuntimeError(f"bootstrap server {self.address} already started")
        self._ctx = zmq.asyncio.Context()
        self._sock = _socket(self._ctx, zmq.ROUTER, self.host, self.max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone D raises instead of vanishing
        self._sock.bind(_endpoint(self.host, self.port or "*"))
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._task = asyncio.create_task(self._serve(), name=f"bootstrap-server-{self.port}")
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

    async def send_ready(self, room: int, *, first_token: int, rope_delta: int, prompt_tokens: int) -> bool:
        """Tell D its KV for ``room`` is in place. False if D is gone or the room is unknown."""
        msg = KVReady(room=room, first_token=first_token, rope_delta=rope_delta, prompt_tokens=prompt_tokens)
        return await self._answer(room, msg)

    async def send_failed(self, room: int, reason: str) -> bool:
        """Tell D that ``room`` failed (or acknowledge its ``Abort``). False if D is gone or unknown."""
        return await self._answer(room, KVFailed(room=room, reason=reason))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
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

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as e:
                if self._closed or e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("bootstrap %s: receive failed: %s", self.address, e)
                await asyncio.sleep(0.01)
                continue
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


# ---------------------------------------------------------------------------------------------------
# Decode side


@dataclass
class _Wait:
    room: int
    link: _Link
    state: Room
    accepted: asyncio.Future[None]
    ready: asyncio.Future[KVReady]
    settled: asyncio.Future[None]  # P has sent its last word for the room (or never got the request)
    sent: bool = False
    abort_reason: str | None = None
    abort_sent: bool = False


@dataclass
class _Link:
    """One DEALER socket to one P address, with the tasks that read it and watch its connection."""

    address: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    rooms: set[int] = field(default_factory=set)
    connected: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def describe(self) -> str:
        return "connected" if self.connected else "not connected: is prefill up and reachable?"


class BootstrapClient:
    """D's endpoint: asks P for a room's KV and waits for it, many rooms at once per P address.

    Contract for the owner (decode's server), per room:
    1. reserve the blocks, then ``await request_kv(host, port, request)``: returns once P accepted;
    2. ``await wait_ready(room, timeout_s)``: the ``KVReady``; decode may start;
    3. on any ``HandshakeError`` from 1 or 2, or to give up (client disconnect), call
       ``await abort(room, reason)``: free the blocks if it returns True, else quarantine them
       (P did not confirm that it stopped writing). ``abort`` is cheap when P already answered.
    Messages for rooms this client does not hold (late answers after an abort) are dropped.
    """

    def __init__(self, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.asyncio.Context()
        self._links: dict[str, _Link] = {}
        self._waits: dict[int, _Wait] = {}
        self._pings: dict[int, asyncio.Future[Pong]] = {}
        self._closed = False

    def state(self, room: int) -> Room | None:
        """The room's state and timestamps while this client holds it."""
        wait = self._waits.get(room)
        return wait.state if wait else None

    async def request_kv(self, p_host: str, p_port: int, request: KVRequest, accept_timeout_s: float = 5.0) -> None:
        """Send ``request`` to P and wait until P accepts it.

        Raises ``HandshakeError`` with P's reason on ``Rejected``, ``HandshakeTimeout`` when P did
        not accept within ``accept_timeout_s``.
        """
        room = request.room
        if self._closed:
            raise HandshakeError(room, "decode's bootstrap client is closed")
        if room in self._waits:
            raise HandshakeError(room, f"room {room} is already in flight on this decode")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + accept_timeout_s
        link = self._link(p_host, p_port)
        futures = (loop.create_future(), loop.create_future(), loop.create_future())
        wait = self._waits[room] = _Wait(room, link, Room.new(room, time.monotonic()), *futures)
        link.rooms.add(room)
        frame = encode(msgspec.structs.replace(request, sent_at=time.time()))
        try:
            await asyncio.wait_for(link.sock.send(frame), accept_timeout_s)
        except BaseException as e:  # nothing left this process: P cannot touch the blocks
            self._end(wait, HandshakeError(room, f"room {room}: request not sent"), settled=True)
            self._forget(room)
            if isinstance(e, TimeoutError):
                raise HandshakeTimeout(
                    room, f"could not send room {room} to prefill {link.address} within {accept_timeout_s:g} s "
                    f"({link.describe()})"
                ) from None
            raise
        wait.sent = True
        if wait.abort_reason is not None:  # abort() was called while the request was being sent
            await self._send_abort(wait)
        try:
            await asyncio.wait_for(asyncio.shield(wait.accepted), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise HandshakeTimeout(
                room, f"prefill {link.address} did not accept room {room} within {accept_timeout_s:g} s "
                f"({link.describe()})"
            ) from None
        except HandshakeError:
            if wait.settled.done():
                self._forget(room)
            raise

    async def wait_ready(self, room: int, timeout_s: float) -> KVReady:
        """P's ``KVReady`` for ``room``; raises ``HandshakeError`` on ``KVFailed``, a lost connection
        or a closed client, ``HandshakeTimeout`` after ``timeout_s``."""
        wait = self._waits.get(room)
        if wait is None:
            raise HandshakeError(room, f"room {room} is not in flight on this decode (never requested, or finished)")
        try:
            return await asyncio.wait_for(asyncio.shield(wait.ready), timeout_s)
        except TimeoutError:
            raise HandshakeTimeout(
                room, f"no KV from prefill {wait.link.address} for room {room} within {timeout_s:g} s "
                f"({wait.link.describe()})"
            ) from None
        finally:
            if wait.settled.done():
                self._forget(room)

    async def abort(self, room: int, reason: str, settle_timeout_s: float = 5.0) -> bool:
        """Give up on ``room``: tell P, end local waits, and wait for P's last word.

        Returns True when D's blocks for the room are safe to reuse (P answered, or never got the
        request), False when P did not answer within ``settle_timeout_s``. Always forgets the room.
        """
        wait = self._waits.get(room)
        if wait is None:
            return True
        if wait.abort_reason is None:
            wait.abort_reason = reason
        self._end(wait, HandshakeError(room, f"room {room} aborted by decode: {reason}"), settled=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle_timeout_s
        try:
            if wait.sent:
                await asyncio.wait_for(self._send_abort(wait), settle_timeout_s)
            await asyncio.wait_for(asyncio.shield(wait.settled), max(0.0, deadline - loop.time()))
            return True
        except TimeoutError:
            log.warning("room %d: prefill %s did not confirm the abort within %g s", room, wait.link.address,
                        settle_timeout_s)
            return False
        finally:
            self._forget(room)

    async def ping(self, p_host: str, p_port: int, timeout_s: float = 2.0) -> Pong:
        """P's ``Pong`` (with its fingerprint); ``HandshakeTimeout`` if none within ``timeout_s``."""
        link = self._link(p_host, p_port)
        nonce = random.getrandbits(63)
        pong = self._pings[nonce] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await link.sock.send(encode(Ping(nonce=nonce, sent_at=time.time())))
                return await pong
        except TimeoutError:
            raise HandshakeTimeout(None, f"no pong from prefill {link.address} within {timeout_s:g} s "
                                         f"({link.describe()})") from None
        finally:
            self._pings.pop(nonce, None)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for wait in list(self._waits.values()):
            self._end(wait, HandshakeError(wait.room, "decode's bootstrap client closed"), settled=False)
        self._waits.clear()
        tasks = [task for link in self._links.values() for task in link.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)
        self._links.clear()

    # -- links -------------------------------------------------------------------------------------

    def _link(self, host: str, port: int) -> _Link:
        address = f"{host}:{port}"
        link = self._links.get(address)
        if link is None:
            sock = _socket(self._ctx, zmq.DEALER, host, self.max_message_bytes)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a P that is not connected
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(_endpoint(host, port))
            link = self._links[address] = _Link(address, sock, monitor)
            link.tasks = [
                asyncio.create_task(self._read(link), name=f"bootstrap-read-{address}"),
                asyncio.create_task(self._watch(link), name=f"bootstrap-watch-{address}"),
            ]
        return link

    async def _read(self, link: _Link) -> None:
        while True:
            try:
                frames = await link.sock.recv_multipart()
            except zmq.ZMQError as e:
                if self._closed or e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("from prefill %s: receive failed: %s", link.address, e)
                await asyncio.sleep(0.01)
                continue
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"expected 1 frame, got {len(frames)}")
                self._dispatch(link, decode(frames[0]))
            except VersionMismatch as e:
                reason = check_version(PROTOCOL_VERSION, e.peer_version, mine_role="decode", theirs_role="prefill")
                log.warning("from prefill %s: %s", link.address, reason)
                wait = self._waits.get(e.room) if e.room is not None else None
                if wait is not None and wait.link is link:
                    self._end(wait, HandshakeError(wait.room, reason or ""), settled=False)
            except ProtocolError as e:
                log.warning("from prefill %s: dropped a frame: %s", link.address, e)
            except Exception:
                log.exception("from prefill %s: error while handling a frame", link.address)

    async def _watch(self, link: _Link) -> None:
        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event == zmq.EVENT_CONNECTED:
                link.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                link.connected = False
                self._on_disconnect(link)

    def _on_disconnect(self, link: _Link) -> None:
        for room in list(link.rooms):
            wait = self._waits.get(room)
            if wait is not None and wait.sent and not wait.settled.done():
                reason = f"lost connection to prefill {link.address} (it stopped or crashed) with room {room} in flight"
                self._end(wait, HandshakeError(room, reason), settled=False)

    def _dispatch(self, link: _Link, msg: Message) -> None:
        if isinstance(msg, Pong):
            pong = self._pings.get(msg.nonce)
            if pong is not None and not pong.done():
                pong.set_result(msg)
            return
        room = getattr(msg, "room", None)
        wait = self._waits.get(room) if isinstance(room, int) else None
        if wait is None or wait.link is not link:
            log.debug("from prefill %s: %s for a room not held here", link.address, type(msg).__name__)
            return
        now = time.monotonic()
        if isinstance(msg, Accepted):
            wait.state.advance(RoomStatus.WaitingForInput, now)
            _resolve(wait.accepted, None)
        elif isinstance(msg, KVReady):
            wait.state.advance(RoomStatus.Success, now)
            _resolve(wait.accepted, None)
            _resolve(wait.ready, msg)
            _resolve(wait.settled, None)
        elif isinstance(msg, Rejected):
            self._end(wait, HandshakeError(room, f"prefill {link.address} rejected room {room}: {msg.reason}"), True)
        elif isinstance(msg, KVFailed):
            self._end(wait, HandshakeError(room, f"prefill {link.address} failed room {room}: {msg.reason}"), True)
        else:
            log.warning("from prefill %s: unexpected %s", link.address, type(msg).__name__)

    def _end(self, wait: _Wait, error: HandshakeError, settled: bool) -> None:
        """Fail the room's pending waits with ``error``; mark it settled when P said its last word."""
        wait.state.fail(error.reason, time.monotonic())
        for future in (wait.accepted, wait.ready):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: no "never retrieved" warning if nobody awaits it
        if settled:
            _resolve(wait.settled, None)

    async def _send_abort(self, wait: _Wait) -> None:
        if wait.abort_sent:
            return
        wait.abort_sent = True
        reason = wait.abort_reason or "aborted"
        await wait.link.sock.send(encode(Abort(room=wait.room, reason=reason, sent_at=time.time())))

    def _forget(self, room: int) -> None:
        wait = self._waits.pop(room, None)
        if wait is not None:
            wait.link.rooms.discard(room)


def _resolve(future: asyncio.Future[object], value: object) -> None:
    if not future.done():
        future.set_result(value)

