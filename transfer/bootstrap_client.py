"""Decode's end of the room handshake: ``BootstrapClient`` (see ``transfer.bootstrap`` for the wire)."""

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

from transfer.bootstrap_common import MAX_MESSAGE_BYTES, HandshakeError, HandshakeTimeout, _endpoint, _receive, _socket
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    KVFailed,
    KVReady,
    KVRequest,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Rejected,
    VersionMismatch,
    check_version,
    decode,
    encode,
)
from transfer.rooms import Room, RoomStatus

log = logging.getLogger(__name__)


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
            frames = await _receive(link.sock, lambda: self._closed, f"from prefill {link.address}")
            if frames is None:
                return
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

