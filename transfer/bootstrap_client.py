"""Decode's end of the room handshake: ``BootstrapClient`` (see ``transfer.bootstrap_common`` for the wire)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar
from dataclasses import dataclass

import msgspec

from process.addresses import host_port
from transfer.bootstrap_common import MAX_MESSAGE_BYTES, HandshakeError, HandshakeTimeout, PeerNotAllowed
from transfer.fingerprint import check_version
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
    decode,
    encode,
)
from transfer.peer_links import PeerLink, PeerLinks
from transfer.peer_policy import AllowList
from transfer.rooms import Room, RoomStatus

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class PrefillFailed(HandshakeError):
    """P refused (``Rejected``) or failed (``KVFailed``) the room. ``code`` and ``image_key`` are
    P's typed fields from that message (the code and image P answers its own client with), None
    when P sent none; ``reason`` is P's prose, prefixed with which prefill and room."""

    def __init__(self, room: int, reason: str, *, code: str | None = None, image_key: str | None = None) -> None:
        super().__init__(room, reason)
        self.code = code
        self.image_key = image_key


@dataclass
class _Wait:
    room: int
    link: PeerLink
    state: Room
    accepted: asyncio.Future[None]
    ready: asyncio.Future[KVReady]
    settled: asyncio.Future[None]  # P has sent its last word for the room (or never got the request)
    heard: float = 0.0  # time.monotonic() of the last frame from P naming the room (or of sending it)
    sent: bool = False
    abort_reason: str | None = None
    abort_sent: bool = False


class BootstrapClient:
    """D's endpoint: asks P for a room's KV and waits for it, many rooms at once per P address.

    Contract for the owner (decode's server), per room:
    1. reserve the blocks, then ``await request_kv(host, port, request)``: returns once P accepted;
    2. ``await wait_ready(room, timeout_s, idle_timeout_s)``: the ``KVReady``; decode may start. P's
       ``Heartbeat`` frames (and every answer) naming the room keep it alive; ``idle_timeout_s`` of
       silence fails it, as ``timeout_s`` in all does;
    3. on any ``HandshakeError`` from 1 or 2, or to give up (client disconnect), call
       ``await abort(room, reason)``: free the blocks if it returns True, else quarantine them
       (P did not confirm that it stopped writing). ``abort`` is cheap when P already answered.
    Messages for rooms this client does not hold (late answers after an abort) are dropped.

    Peers: ``request_kv`` and ``ping`` dial only the addresses ``allow`` allows (default: loopback)
    and raise ``PeerNotAllowed`` before creating anything otherwise. The owner may ``allow.add`` /
    ``allow.remove`` patterns at runtime (the router registering prefills); a removed address's open
    link stays until it is idle. Links are cached in ``links`` (``transfer.peer_links``): at most
    ``max_links``, least recently used idle one evicted first, idle ones closed after
    ``link_idle_s`` (at once when not connected).

    Each room's state (``transfer.rooms.Room``: ``Bootstrapping`` when its request is sent,
    ``WaitingForInput`` when P accepted it, ``Success`` on ``KVReady``, ``Failed`` with the reason of
    any ``HandshakeError`` or abort) is given to ``on_change`` at every status it enters.
    """

    def __init__(self, *, allow: AllowList | None = None, max_links: int = 64, link_idle_s: float = 60.0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, on_change: Callable[[Room], None] | None = None) -> None:
        self.allow = allow if allow is not None else AllowList()
        self._on_change = on_change
        self.links = PeerLinks(max_links=max_links, link_idle_s=link_idle_s, max_message_bytes=max_message_bytes,
                               on_frames=self._on_frames, on_disconnect=self._on_disconnect)
        self._waits: dict[int, _Wait] = {}
        self._pings: dict[int, asyncio.Future[Pong]] = {}
        self._closed = False

    def state(self, room: int) -> Room | None:
        """The room's state and timestamps while this client holds it."""
        wait = self._waits.get(room)
        return wait.state if wait else None

    async def request_kv(self, p_host: str, p_port: int, request: KVRequest, accept_timeout_s: float = 5.0) -> None:
        """Send ``request`` to P and wait until P accepts it.

        Raises ``PeerNotAllowed`` (nothing dialed) when ``allow`` does not allow ``p_host:p_port``,
        ``PrefillFailed`` (a ``HandshakeError``) with P's reason and typed fields on ``Rejected``,
        ``HandshakeError`` when all ``max_links`` links are busy,
        ``HandshakeTimeout`` when P did not accept within ``accept_timeout_s``.
        """
        room = request.room
        if self._closed:
            raise HandshakeError(room, "decode's bootstrap client is closed")
        self._check_allowed(room, p_host, p_port)
        if room in self._waits:
            raise HandshakeError(room, f"room {room} is already in flight on this decode")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + accept_timeout_s
        link = self.links.acquire(p_host, p_port, room)
        futures = (loop.create_future(), loop.create_future(), loop.create_future())
        wait = self._waits[room] = _Wait(room, link, Room.new(room, time.monotonic(), self._on_change), *futures)
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
        wait.heard = time.monotonic()
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

    async def wait_ready(self, room: int, timeout_s: float, idle_timeout_s: float | None = None) -> KVReady:
        """P's ``KVReady`` for ``room``; raises ``PrefillFailed`` (P's reason and typed fields) on
        ``KVFailed`` (or ``Rejected``), ``HandshakeError`` on a lost connection or a closed client,
        ``HandshakeTimeout`` after ``timeout_s`` in all, or as soon as P has sent nothing naming the
        room (no ``Heartbeat``, no answer) for ``idle_timeout_s`` (None: no idle bound). Silence is
        counted from the request's send, then from each frame of P's that names the room."""
        wait = self._waits.get(room)
        if wait is None:
            raise HandshakeError(room, f"room {room} is not in flight on this decode (never requested, or finished)")
        deadline = time.monotonic() + timeout_s
        try:
            while not wait.ready.done():
                now = time.monotonic()
                if now >= deadline:
                    raise HandshakeTimeout(
                        room, f"no KV from prefill {wait.link.address} for room {room} within {timeout_s:g} s "
                        f"(--kv-timeout-s; {wait.link.describe()})")
                budget = deadline - now
                if idle_timeout_s is not None:
                    silent_s = now - wait.heard
                    if silent_s >= idle_timeout_s:
                        raise HandshakeTimeout(
                            room, f"prefill {wait.link.address} went silent with room {room} in flight: nothing "
                            f"from it for {silent_s:.1f} s (--peer-idle-timeout-s {idle_timeout_s:g}; it stopped, "
                            "hung or became unreachable)")
                    budget = min(budget, idle_timeout_s - silent_s)
                await asyncio.wait({wait.ready}, timeout=budget)
            return wait.ready.result()
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
        """P's ``Pong`` (with its fingerprint); ``HandshakeTimeout`` if none within ``timeout_s``,
        ``PeerNotAllowed`` (nothing dialed) if ``allow`` does not allow ``p_host:p_port``."""
        if self._closed:
            raise HandshakeError(None, "decode's bootstrap client is closed")
        self._check_allowed(None, p_host, p_port)
        link = self.links.acquire(p_host, p_port, None)
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
            self.links.release(link, None)

    async def close(self) -> None:
        """End every wait, then close every link. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for wait in list(self._waits.values()):
            self._end(wait, HandshakeError(wait.room, "decode's bootstrap client closed"), settled=False)
        self._waits.clear()
        await self.links.close()

    # -- peers and frames ----------------------------------------------------------------------------

    def _check_allowed(self, room: int | None, host: str, port: int) -> None:
        if not self.allow.allows(host, port):
            raise PeerNotAllowed(
                room, f"prefill {host_port(host, port)} is not allowed by --allowed-bootstrap (allowed: {self.allow})"
            )

    def _on_frames(self, link: PeerLink, frames: list[bytes]) -> None:
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

    def _on_disconnect(self, link: PeerLink) -> None:
        for room in list(link.rooms):
            wait = self._waits.get(room)
            if wait is not None and wait.sent and not wait.settled.done():
                reason = f"lost connection to prefill {link.address} (it stopped or crashed) with room {room} in flight"
                self._end(wait, HandshakeError(room, reason), settled=False)

    def _dispatch(self, link: PeerLink, msg: Message) -> None:
        if isinstance(msg, Pong):
            pong = self._pings.get(msg.nonce)
            if pong is not None and not pong.done():
                pong.set_result(msg)
            return
        if isinstance(msg, Heartbeat):
            self._heard(link, msg.rooms)
            return
        room = getattr(msg, "room", None)
        wait = self._waits.get(room) if isinstance(room, int) else None
        if wait is None or wait.link is not link:
            log.debug("from prefill %s: %s for a room not held here", link.address, type(msg).__name__)
            return
        now = wait.heard = time.monotonic()
        if isinstance(msg, Accepted):
            wait.state.advance(RoomStatus.WaitingForInput, now)
            _resolve(wait.accepted, None)
        elif isinstance(msg, KVReady):
            wait.state.advance(RoomStatus.Success, now)
            _resolve(wait.accepted, None)
            _resolve(wait.ready, msg)
            _resolve(wait.settled, None)
        elif isinstance(msg, Rejected | KVFailed):
            did = "rejected" if isinstance(msg, Rejected) else "failed"
            error = PrefillFailed(msg.room, f"prefill {link.address} {did} room {room}: {msg.reason}", code=msg.code,
                                  image_key=msg.image_key)
            self._end(wait, error, True)
        else:
            log.warning("from prefill %s: unexpected %s", link.address, type(msg).__name__)

    def _heard(self, link: PeerLink, rooms: list[int]) -> None:
        """P's ``Heartbeat``: each of ``rooms`` this client holds on ``link`` was heard from now."""
        now = time.monotonic()
        for room in rooms:
            wait = self._waits.get(room)
            if wait is not None and wait.link is link:
                wait.heard = now

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
            self.links.release(wait.link, room)


def _resolve(future: asyncio.Future[_T], value: _T) -> None:
    if not future.done():
        future.set_result(value)

