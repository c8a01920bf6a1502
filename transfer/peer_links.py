"""Decode's links to prefill bootstrap addresses: ``PeerLinks``, a capped cache with idle expiry.

A ``PeerLink`` is one DEALER socket to one P address, the monitor socket that reports whether it is
connected, and two tasks that read them. ``BootstrapClient`` (the only user) speaks the protocol
over the links; this module owns the ZeroMQ context, the sockets and the tasks, and frees them:

- a link is busy while it has rooms or pings in flight (``acquire`` / ``release``), else idle;
- an idle link that is not connected (P never came up, or went away) is closed at once, so an
  address nothing listens on leaves nothing behind;
- an idle connected link is closed after ``link_idle_s``, by one timer (``loop.call_at``, not a
  task) armed for the earliest expiry whenever a link goes idle and re-armed after each sweep;
- at ``max_links``, a new address evicts the least recently used idle link; when every link is
  busy, ``acquire`` raises ``HandshakeError`` (decode is talking to too many prefills).

Closing a link cancels its tasks, then, once they ended, stops its monitor and closes both sockets
with linger 0. Everything runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from process.addresses import host_port
from transfer.bootstrap_common import HandshakeError, _endpoint, _receive, _socket

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass
class PeerLink:
    """One DEALER socket to one P address, with the tasks that read it and watch its connection."""

    address: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    idle_since: float  # loop time when it last had nothing in flight
    rooms: set[int] = field(default_factory=set)
    pings: int = 0
    connected: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        return bool(self.rooms) or self.pings > 0

    def describe(self) -> str:
        return "connected" if self.connected else "not connected: is prefill up and reachable?"


class PeerLinks:
    """The cached links of one ``BootstrapClient``.

    ``on_frames(link, frames)`` is called for each message a link receives and
    ``on_disconnect(link)`` when a connected link loses its peer; both run on the loop, must not
    block, and may not ``release``. Errors they raise are logged and the link keeps reading.
    """

    def __init__(self, *, max_links: int, link_idle_s: float, max_message_bytes: int,
                 on_frames: Callable[[PeerLink, list[bytes]], None],
                 on_disconnect: Callable[[PeerLink], None]) -> None:
        if max_links < 1:
            raise ValueError(f"max_links must be >= 1, got {max_links}")
        if link_idle_s <= 0:
            raise ValueError(f"link_idle_s must be > 0, got {link_idle_s}")
        self.max_links = max_links
        self.link_idle_s = link_idle_s
        self.max_message_bytes = max_message_bytes
        self._on_frames = on_frames
        self._on_disconnect = on_disconnect
        self._ctx = zmq.asyncio.Context()
        self._links: OrderedDict[str, PeerLink] = OrderedDict()  # least recently used first
        self._retiring: set[asyncio.Future[list[BaseException | None]]] = set()  # closed links whose tasks are ending
        self._timer: asyncio.TimerHandle | None = None
        self._monitor_ids = itertools.count()
        self._closed = False

    def addresses(self) -> list[str]:
        """Open links' addresses, least recently used first."""
        return list(self._links)

    def get(self, address: str) -> PeerLink | None:
        return self._links.get(address)

    def acquire(self, host: str, port: int, room: int | None) -> PeerLink:
        """The link to ``host:port`` (cached or new, now the most recently used), busy with ``room``
        (or with one ping when ``room`` is None) until ``release``. The caller checked that the
        address is allowed. Raises ``HandshakeError`` when all ``max_links`` links are busy."""
        address = host_port(host, port)
        link = self._links.get(address)
        if link is not None:
            self._links.move_to_end(address)
        else:
            if len(self._links) >= self.max_links:
                self._evict(room)
            link = self._links[address] = self._open(host, port, address)
        if room is None:
            link.pings += 1
        else:
            link.rooms.add(room)
        return link

    def release(self, link: PeerLink, room: int | None) -> None:
        """``room`` (or one ping) is done with ``link``; an idle link is closed at once if it is not
        connected, else after ``link_idle_s``."""
        if room is None:
            link.pings -= 1
        else:
            link.rooms.discard(room)
        if link.busy or self._links.get(link.address) is not link:
            return
        link.idle_since = asyncio.get_running_loop().time()
        if not link.connected:
            self._retire(link)
        else:
            self._arm()

    async def settle(self) -> None:
        """Wait until every closed link's tasks ended and its sockets are closed."""
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def close(self) -> None:
        """Close every link, busy or not, and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for link in list(self._links.values()):
            self._retire(link)
        await self.settle()
        self._ctx.destroy(linger=0)

    def _evict(self, room: int | None) -> None:
        victim = next((link for link in self._links.values() if not link.busy), None)
        if victim is None:
            raise HandshakeError(
                room, f"decode is talking to too many prefills: all {self.max_links} prefill links "
                "(max_links) have rooms in flight; retry when one finishes"
            )
        self._retire(victim)

    def _open(self, host: str, port: int, address: str) -> PeerLink:
        sock = _socket(self._ctx, zmq.DEALER, host, self.max_message_bytes)
        monitor = None
        try:
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a P that is not connected
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            # A unique name: a new socket reusing a closed one's fd must not meet its closing monitor.
            monitor = sock.get_monitor_socket(_EVENTS, f"inproc://bootstrap-monitor-{next(self._monitor_ids)}")
            sock.connect(_endpoint(host, port))
        except BaseException:
            _close_sockets(sock, monitor)
            raise
        link = PeerLink(address, sock, monitor, idle_since=asyncio.get_running_loop().time())
        link.tasks = [
            asyncio.create_task(self._read(link), name=f"bootstrap-read-{address}"),
            asyncio.create_task(self._watch(link), name=f"bootstrap-watch-{address}"),
        ]
        return link

    def _arm(self) -> None:
        if self._timer is not None or self._closed:
            return
        idle = [link.idle_since for link in self._links.values() if not link.busy]
        if idle:
            self._timer = asyncio.get_running_loop().call_at(min(idle) + self.link_idle_s, self._sweep)

    def _sweep(self) -> None:
        """Timer callback: close the links idle for ``link_idle_s``, then re-arm for the next."""
        self._timer = None
        now = asyncio.get_running_loop().time() + 1e-3  # the timer may fire a hair early
        for link in list(self._links.values()):
            if not link.busy and link.idle_since + self.link_idle_s <= now:
                self._retire(link)
        self._arm()

    def _retire(self, link: PeerLink) -> None:
        """Drop ``link`` from the cache and cancel its tasks; its sockets close once they ended."""
        del self._links[link.address]
        for task in link.tasks:
            task.cancel()
        ended = asyncio.gather(*link.tasks, return_exceptions=True)
        self._retiring.add(ended)

        def close(_: object) -> None:
            self._retiring.discard(ended)
            _close_sockets(link.sock, link.monitor)

        ended.add_done_callback(close)

    async def _read(self, link: PeerLink) -> None:
        while True:
            frames = await _receive(link.sock, lambda: self._closed, f"from prefill {link.address}")
            if frames is None:
                return
            try:
                self._on_frames(link, frames)
            except Exception:
                log.exception("from prefill %s: error while handling a frame", link.address)

    async def _watch(self, link: PeerLink) -> None:
        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event == zmq.EVENT_CONNECTED:
                link.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                link.connected = False
                try:
                    self._on_disconnect(link)
                except Exception:
                    log.exception("prefill %s: error while handling a lost connection", link.address)


def _close_sockets(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket | None) -> None:
    if monitor is not None:
        if not sock.closed:
            sock.disable_monitor()
        monitor.close(linger=0)
    sock.close(linger=0)
