"""When each image landed in the cache: a Redis subscriber whose socket has the kernel stamp every
packet (``LandingClock``), the RESP parsing it needs (``parse_pushes``, pure), and the entries'
``created_at`` (the upper bound)."""

from __future__ import annotations

import json
import threading
import time


def parse_pushes(buffer: bytes) -> tuple[list[list[bytes]], int]:
    """The complete RESP2 arrays of bulk strings and integers at the start of ``buffer`` (what a
    subscribed connection receives: ``subscribe`` confirmations, ``message`` pushes), and how many
    bytes they took; an incomplete tail is left for the next read. Pure."""
    out, pos = [], 0
    while True:
        item, end = _parse_array(buffer, pos)
        if item is None:
            return out, pos
        out.append(item)
        pos = end


def _parse_array(buffer: bytes, pos: int) -> tuple[list[bytes] | None, int]:
    line_end = buffer.find(b"\r\n", pos)
    if line_end < 0:
        return None, pos
    if buffer[pos:pos + 1] != b"*":
        raise ValueError(f"not a RESP array at byte {pos}: {buffer[pos:pos + 40]!r}")
    items, cursor = [], line_end + 2
    for _ in range(int(buffer[pos + 1:line_end])):
        end = buffer.find(b"\r\n", cursor)
        if end < 0:
            return None, pos
        kind, value = buffer[cursor:cursor + 1], buffer[cursor + 1:end]
        if kind == b":":
            items.append(value)
            cursor = end + 2
        elif kind == b"$":
            start, size = end + 2, int(value)
            if len(buffer) < start + size + 2:
                return None, pos
            items.append(buffer[start:start + size])
            cursor = start + size + 2
        else:
            raise ValueError(f"unexpected RESP type {kind!r} at byte {cursor}")
    return items, cursor


class LandingClock:
    """When each image landed in the cache: the cache's write script ends by publishing the key's
    ``ready`` event, and this subscriber's socket asks the kernel to stamp every packet as it arrives
    (``SO_TIMESTAMPNS``, wall clock). On loopback the stamp is taken inside Redis's own ``write`` of
    the event, the moment it reaches every subscriber (the waiting prefill included); when this
    thread reads it later does not matter. A read that holds several events carries the last
    packet's stamp: only the last of them is dated (the others landed before it; counted in
    ``shared_stamps``)."""

    SO_TIMESTAMPNS = 35  # <asm-generic/socket.h>; the socket module does not name it

    def __init__(self, redis_url: str) -> None:
        import socket
        from urllib.parse import urlsplit

        from cache.scripts import CHANNEL

        url = urlsplit(redis_url)
        if url.scheme != "redis":
            raise ValueError(f"LandingClock needs a redis://HOST:PORT Redis, got {redis_url!r}")
        self.landed: dict[str, float | None] = {}  # every ready key heard -> its stamp, None if undated
        self.shared_stamps = 0
        self._buffer = b""
        self._closing = threading.Event()
        self._sock = socket.create_connection((url.hostname, url.port or 6379), timeout=10)
        self._sock.setsockopt(socket.SOL_SOCKET, self.SO_TIMESTAMPNS, 1)
        name = CHANNEL.encode()
        self._sock.sendall(b"*2\r\n$9\r\nSUBSCRIBE\r\n$%d\r\n%s\r\n" % (len(name), name))
        while not self._read_once():  # the confirmation: from here on every event reaches this socket
            pass
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, name="landing-clock", daemon=True)
        self._thread.start()

    def _read_once(self) -> list[list[bytes]]:
        import struct

        data, ancillary, _, _ = self._sock.recvmsg(1 << 16, 64)
        if not data:
            raise ConnectionError("Redis closed the subscriber's connection")
        stamp = next((sec + nsec / 1e9 for level, kind, raw in ancillary if kind == self.SO_TIMESTAMPNS
                      for sec, nsec in [struct.unpack("qq", raw[:16])]), None)
        pushes, used = parse_pushes(self._buffer + data)
        self._buffer = (self._buffer + data)[used:]
        events = [json.loads(p[2]) for p in pushes if p[0] == b"message"]
        ready = [e["key"] for e in events if e.get("kind") == "ready"]
        for key in ready[:-1]:
            self.landed.setdefault(key, None)
        if ready:
            self.landed.setdefault(ready[-1], stamp)
            self.shared_stamps += len(ready) - 1
        return pushes

    def last_landing(self, keys: list[str], timeout_s: float = 2.0) -> float | None:
        """When the last of ``keys`` landed: the latest stamp among them, once every key's event has
        been read (within ``timeout_s``; None if not, or if none of them is dated). Keys are heard in
        the order they land, and an undated one landed before a dated one read with it, so the latest
        stamp is the last landing as long as ``keys`` are one request's, one request at a time."""
        deadline = time.monotonic() + timeout_s
        while any(k not in self.landed for k in keys):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        stamps = [self.landed[k] for k in keys if self.landed[k] is not None]
        return max(stamps) if stamps else None

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                self._read_once()
            except TimeoutError:
                continue
            except OSError:  # Redis stopped, or close()
                return

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
        self._sock.close()


def created_at(redis_url: str, keys: list[str]) -> dict[str, float]:
    """The cache entry's ``created_at`` of each key still cached."""
    import redis

    from cache.entry import decode_entry
    from cache.scripts import entry_key

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        out = {}
        for key in keys:
            meta = client.hget(entry_key(key), "meta")
            if meta is not None:
                out[key] = decode_entry(meta).created_at
        return out
    finally:
        client.close()
