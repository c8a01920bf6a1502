"""The room handshake: codec, compatibility checks, and real ZeroMQ endpoints over 127.0.0.1.

Ports are picked by the OS at bind time (port 0), so runs never collide. Every test has a timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import zmq
import zmq.asyncio

from tests.support.bootstrap_peers import FP, HOST, kv_request, raw_router
from transfer.bootstrap_client import BootstrapClient, PrefillFailed
from transfer.bootstrap_common import BootstrapClosed, HandshakeError, HandshakeTimeout, PeerNotAllowed
from transfer.bootstrap_server import BootstrapServer
from transfer.fingerprint import Fingerprint, check_compatible, model_identity
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    KVFailed,
    KVReady,
    KVRequest,
    Ping,
    Pong,
    Heartbeat,
    ProtocolError,
    Rejected,
    VersionMismatch,
    decode,
    encode,
)
from transfer.peer_policy import AllowList
from transfer.rooms import RoomClosed, RoomTable

pytestmark = pytest.mark.timeout(30)
aio = pytest.mark.asyncio


def first_token(room: int) -> int:
    return room % 100_003


# ---------------------------------------------------------------------------------------------------
# Codec


ALL_MESSAGES = [
    kv_request(2**63 - 1),
    Abort(room=1, reason="client disconnected", sent_at=12.5),
    Ping(nonce=99),
    Accepted(room=1),
    Rejected(room=1, reason="block size differs"),
    Rejected(room=1, reason="image not cached", code="image_not_cached", image_key="ab" * 32),
    KVReady(room=1, first_token=42, rope_delta=-3, prompt_tokens=20),
    KVFailed(room=1, reason="prefill out of memory"),
    KVFailed(room=1, reason="the encoder failed", code="encode_failed", image_key="cd" * 32),
    Pong(nonce=99, fingerprint=FP),
    Heartbeat(rooms=[1, 2**63 - 1]),
]


@pytest.mark.unit
@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_codec_round_trip(msg: object) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    assert back.version == PROTOCOL_VERSION


GARBAGE = [
    b"",
    b"\xc1",
    b"\x00" * 10,
    b"hello, prefill",
    bytes(random.Random(0).getrandbits(8) for _ in range(200)),
    msgspec.msgpack.encode([1, 2, 3]),
    msgspec.msgpack.encode({"room": 1}),
    msgspec.msgpack.encode({"type": "Nope", "room": 1}),
    msgspec.msgpack.encode({"type": "KVReady", "room": "one", "first_token": 1, "rope_delta": 0, "prompt_tokens": 1}),
    msgspec.msgpack.encode({"type": "Accepted"}),
    msgspec.msgpack.encode({"type": "Pong", "nonce": 1, "fingerprint": {**msgspec.to_builtins(FP), "block_size": 0}}),
    encode(Accepted(room=1))[:-1],
]


@pytest.mark.unit
@pytest.mark.parametrize("data", GARBAGE)
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert not isinstance(info.value, VersionMismatch)


class _KVFailedV1(msgspec.Struct, tag="KVFailed", frozen=True, kw_only=True):
    """``KVFailed`` as version 1 first defined it, before ``code`` and ``image_key``."""

    version: int = PROTOCOL_VERSION
    sent_at: float = 0.0
    room: int
    reason: str


@pytest.mark.unit
def test_the_typed_failure_fields_keep_older_frames_readable_both_ways() -> None:
    """``code`` / ``image_key`` are optional: a frame without them (an older peer) decodes with None,
    and a frame with them decodes under the older definition, which ignores them. So they changed
    no protocol version (version 2 is ``Heartbeat``'s)."""
    assert PROTOCOL_VERSION == 2
    old = msgspec.msgpack.encode(_KVFailedV1(room=3, reason="boom"))
    assert decode(old) == KVFailed(room=3, reason="boom", code=None, image_key=None)
    bare = msgspec.msgpack.encode({"type": "Rejected", "version": PROTOCOL_VERSION, "room": 4, "reason": "no"})
    assert decode(bare) == Rejected(room=4, reason="no")
    new = encode(KVFailed(room=3, reason="boom", code="encode_failed", image_key="ab" * 32))
    assert msgspec.msgpack.decode(new, type=_KVFailedV1) == _KVFailedV1(room=3, reason="boom")


@pytest.mark.unit
def test_other_version_is_a_version_mismatch_with_room() -> None:
    with pytest.raises(VersionMismatch) as info:
        decode(encode(kv_request(7, version=1)))
    assert (info.value.peer_version, info.value.room) == (1, 7)
    # A newer peer's frame that this version cannot even parse still reads as a version mismatch.
    with pytest.raises(VersionMismatch) as info:
        decode(msgspec.msgpack.encode({"type": "KVRequest2", "version": 3, "room": 8}))
    assert (info.value.peer_version, info.value.room) == (3, 8)


@pytest.mark.unit
def test_model_identity_ignores_paths_and_names() -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "_name_or_path": "/a", "text_config": {"dtype": "x"}}
    moved = {**config, "_name_or_path": "/elsewhere/copy", "transformers_version": "5.0", "text_config": {}}
    assert model_identity("llama", config) == model_identity("llama", moved)
    assert model_identity("llama", config).startswith("llama-")
    assert model_identity("llama", config) != model_identity("llama", {**config, "num_hidden_layers": 3})


@pytest.mark.unit
def test_fingerprint_validates() -> None:
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(FP, block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(FP, dtype="")
    with pytest.raises(ValueError, match=r"Fingerprint.memory must be one of \('DRAM', 'VRAM'\), got 'HBM'"):
        dataclasses.replace(FP, memory="HBM")


MISMATCHES = [
    ("model", "llava-fedcba9876543210",
     "model differs: prefill qwen2_vl-0123456789abcdef, decode llava-fedcba9876543210; "
     "serve the same checkpoint (--model) on prefill and decode"),
    ("backend", "nixl",
     "transfer backend differs: prefill mooncake, decode nixl; start both with the same --transfer"),
    ("memory", "VRAM", "KV memory differs: prefill DRAM, decode VRAM; run prefill and decode on the same kind of "
     "device (--device cpu on both, or --device cuda[:N] on both)"),
    ("dtype", "float16", "KV dtype differs: prefill bfloat16, decode float16; start both with the same --dtype"),
    ("block_size", 32, "block size differs: prefill 16, decode 32; start both with the same --block-size"),
    ("num_layers", 8,
     "layer count differs: prefill 4, decode 8; "
     "serve the same checkpoint (--model) with the same release on prefill and decode"),
    ("num_kv_heads", 8,
     "KV head count differs: prefill 2, decode 8; "
     "serve the same checkpoint (--model) with the same release on prefill and decode"),
    ("head_dim", 128,
     "head dim differs: prefill 64, decode 128; "
     "serve the same checkpoint (--model) with the same release on prefill and decode"),
    ("block_bytes", 1,
     "KV block bytes differ: prefill 32768, decode 1; run the same release on prefill and decode "
     "(KV pool layouts differ)"),
]


@pytest.mark.unit
def test_check_compatible_pure() -> None:
    assert check_compatible(FP, dataclasses.replace(FP)) is None
    both = dataclasses.replace(FP, dtype="float16", block_size=32)
    assert check_compatible(FP, both) == (
        "KV dtype differs: prefill bfloat16, decode float16; start both with the same --dtype | "
        "block size differs: prefill 16, decode 32; start both with the same --block-size"
    )
    # Another model explains its other shapes; only the model is named.
    other = dataclasses.replace(FP, model="llama-1", num_layers=32, head_dim=128)
    assert check_compatible(FP, other).startswith("model differs:")
    assert "layer count" not in check_compatible(FP, other)


# ---------------------------------------------------------------------------------------------------
# Endpoints


@asynccontextmanager
async def prefill(fp: Fingerprint = FP, **kw: object) -> AsyncIterator[BootstrapServer]:
    server = BootstrapServer(fp, HOST, 0, **kw)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@asynccontextmanager
async def decode_client() -> AsyncIterator[BootstrapClient]:
    client = BootstrapClient()
    try:
        yield client
    finally:
        await client.close()


class FakePrefill:
    """The owner of a BootstrapServer reduced to pairing: answers KVReady once both halves are in,
    acknowledges aborts, and (when told) expires unpaired rooms the way prefill's server should."""

    def __init__(self, server: BootstrapServer, *, expire_deadline_s: float | None = None) -> None:
        self.server = server
        self.table: RoomTable[str, KVRequest] = RoomTable()
        self.aborts: list[Abort] = []
        self.expired: list[int] = []
        self.expire_deadline_s = expire_deadline_s
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> FakePrefill:
        self._tasks.append(asyncio.create_task(self._serve()))
        if self.expire_deadline_s is not None:
            self._tasks.append(asyncio.create_task(self._expire_every(0.05)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def http(self, room: int) -> None:
        """P's own request for ``room`` arrives from the router."""
        entry = self.table.add_local(room, "prompt", time.monotonic())
        if entry is not None:
            await self._finish(room)

    async def _serve(self) -> None:
        while True:
            try:
                event = await self.server.recv()
            except BootstrapClosed:
                return
            if isinstance(event, Abort):
                self.aborts.append(event)
                self.table.remove(event.room, reason=f"aborted by decode: {event.reason}")
                await self.server.send_failed(event.room, f"aborted by decode: {event.reason}")
            elif self.table.add_remote(event.room, event, time.monotonic()) is not None:
                await self._finish(event.room)

    async def _finish(self, room: int) -> None:
        entry = self.table.remove(room)
        assert entry is not None and entry.remote is not None
        await asyncio.sleep(random.random() * 0.01)  # "prefill and transfer"
        await self.server.send_ready(KVReady(room=room, first_token=first_token(room), rope_delta=-(room % 7),
                                             prompt_tokens=entry.remote.prompt_tokens))

    async def _expire_every(self, period_s: float) -> None:
        assert self.expire_deadline_s is not None
        while True:
            await asyncio.sleep(period_s)
            for entry in self.table.expire(time.monotonic(), self.expire_deadline_s):
                self.expired.append(entry.room)
                if entry.remote is not None:
                    assert entry.state.reason is not None
                    await self.server.send_failed(entry.room, entry.state.reason)


@aio
@pytest.mark.parametrize("order", ["decode_first", "prefill_first", "concurrent"])
async def test_handshake_in_any_order(order: str) -> None:
    room = 1234567
    async with prefill() as server, FakePrefill(server) as owner, decode_client() as client:
        if order == "prefill_first":
            await owner.http(room)
            await client.request_kv(HOST, server.port, kv_request(room))
        elif order == "decode_first":
            await client.request_kv(HOST, server.port, kv_request(room))
            assert client.state(room).status.name == "WaitingForInput"
            await owner.http(room)
        else:
            await asyncio.gather(client.request_kv(HOST, server.port, kv_request(room)), owner.http(room))
        ready = await client.wait_ready(room, timeout_s=5)
        assert (ready.room, ready.first_token, ready.rope_delta, ready.prompt_tokens) == (room, first_token(room),
                                                                                           -(room % 7), 20)
        assert ready.sent_at > 0
        assert client.state(room) is None and server.rooms == frozenset()
        assert await client.abort(room, "already done") is True


@aio
async def test_sixteen_rooms_route_to_the_right_decode() -> None:
    rng = random.Random(1)
    rooms = [rng.getrandbits(63) for _ in range(16)]
    async with prefill() as server, FakePrefill(server) as owner, decode_client() as d0, decode_client() as d1:
        owner_of = {room: (d0 if i % 2 else d1) for i, room in enumerate(rooms)}

        async def one_decode_room(room: int) -> tuple[int, KVReady]:
            client = owner_of[room]
            await client.request_kv(HOST, server.port, kv_request(room, decode_id=f"d{id(client)}"))
            return room, await client.wait_ready(room, timeout_s=10)

        async def one_prefill_room(room: int) -> None:
            await asyncio.sleep(rng.random() * 0.05)
            await owner.http(room)

        results = await asyncio.gather(*map(one_decode_room, rooms), *map(one_prefill_room, rooms))
        got = dict(r for r in results if r is not None)
        assert set(got) == set(rooms)
        for room, ready in got.items():
            assert ready.room == room and ready.first_token == first_token(room)
        assert server.rooms == frozenset() and len(owner.table) == 0
        assert len(d0.links.addresses()) == len(d1.links.addresses()) == 1  # one link per prefill, shared by rooms


@aio
@pytest.mark.parametrize(("field", "value", "expected"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
async def test_fingerprint_mismatch_is_rejected_with_the_fix(field: str, value: object, expected: str) -> None:
    async with prefill() as server, FakePrefill(server), decode_client() as client:
        theirs = dataclasses.replace(FP, **{field: value})
        with pytest.raises(HandshakeError) as info:
            await client.request_kv(HOST, server.port, kv_request(5, fp=theirs), accept_timeout_s=5)
        assert str(info.value) == f"prefill {HOST}:{server.port} rejected room 5: {expected}"
        assert info.value.room == 5 and not isinstance(info.value, HandshakeTimeout)
        assert isinstance(info.value, PrefillFailed) and info.value.code is None  # a refusal of its own: no code
        assert client.state(5) is None and server.rooms == frozenset()
        assert await client.abort(5, "cleanup") is True  # rejected: blocks are safe at once


@aio
async def test_version_mismatch_is_rejected_by_prefill() -> None:
    async with prefill() as server, FakePrefill(server), decode_client() as client:
        with pytest.raises(HandshakeError) as info:
            await client.request_kv(HOST, server.port, kv_request(6, version=1))
        assert str(info.value) == (
            f"prefill {HOST}:{server.port} rejected room 6: "
            "protocol version differs: prefill 2, decode 1; run the same release on prefill and decode"
        )
        assert server.bad_frames == 1


@aio
async def test_version_mismatch_from_prefill_reaches_decode() -> None:
    async with raw_router() as (sock, port), decode_client() as client:
        pending = asyncio.create_task(client.request_kv(HOST, port, kv_request(8)))
        identity, _ = await sock.recv_multipart()
        await sock.send_multipart([identity, encode(Accepted(room=8, version=1))])
        with pytest.raises(HandshakeError) as info:
            await pending
        assert str(info.value) == (
            "protocol version differs: decode 2, prefill 1; run the same release on decode and prefill"
        )


@aio
async def test_invalid_requests_are_rejected() -> None:
    async with prefill(max_rooms=1) as server, FakePrefill(server), decode_client() as d0, decode_client() as d1:
        with pytest.raises(HandshakeError, match=r"decode reserved 1 blocks of 16 tokens \(16 slots\) for a 20-token"):
            await d0.request_kv(HOST, server.port, kv_request(1, block_ids=[0]))
        await d0.request_kv(HOST, server.port, kv_request(2))
        with pytest.raises(HandshakeError, match="room 2 is already in flight on this decode"):
            await d0.request_kv(HOST, server.port, kv_request(2))
        with pytest.raises(HandshakeError, match="room 2 is already in flight on this prefill"):
            await d1.request_kv(HOST, server.port, kv_request(2))
        with pytest.raises(HandshakeError, match=r"is full \(1 rooms in flight\)"):
            await d1.request_kv(HOST, server.port, kv_request(3))
        assert server.rooms == frozenset({2})


@aio
async def test_partner_never_arrives_is_expired_and_reported() -> None:
    async with prefill() as server, FakePrefill(server, expire_deadline_s=0.2) as owner, decode_client() as client:
        await client.request_kv(HOST, server.port, kv_request(11))  # P's own request never comes
        await owner.http(12)  # decode's KV request never comes
        with pytest.raises(HandshakeError) as info:
            await client.wait_ready(11, timeout_s=5)
        assert str(info.value) == (
            f"prefill {HOST}:{server.port} failed room 11: "
            "partner never arrived within 0.2 s (prefill's own request missing)"
        )
        assert await client.abort(11, "cleanup") is True
        for _ in range(100):
            if 12 in owner.expired:
                break
            await asyncio.sleep(0.02)
        assert sorted(owner.expired) == [11, 12]
        with pytest.raises(RoomClosed, match="decode's KV request missing"):
            owner.table.add_remote(12, kv_request(12), time.monotonic())


@aio
async def test_decode_abort_reaches_prefill_and_is_acknowledged() -> None:
    async with prefill() as server, FakePrefill(server) as owner, decode_client() as client:
        await client.request_kv(HOST, server.port, kv_request(21))
        waiter = asyncio.create_task(client.wait_ready(21, timeout_s=5))
        assert await client.abort(21, "client disconnected", settle_timeout_s=5) is True
        assert owner.aborts == [Abort(room=21, reason="client disconnected", sent_at=owner.aborts[0].sent_at)]
        with pytest.raises(HandshakeError, match="room 21 aborted by decode: client disconnected"):
            await waiter
        with pytest.raises(RoomClosed, match="aborted by decode: client disconnected"):
            await owner.http(21)  # P's own request, late: refused at once
        assert server.rooms == frozenset() and client.state(21) is None


@aio
async def test_abort_unconfirmed_by_prefill_returns_false() -> None:
    async with prefill() as server, decode_client() as client:  # nobody consumes server.recv()
        await client.request_kv(HOST, server.port, kv_request(22))
        started = time.monotonic()
        assert await client.abort(22, "timeout", settle_timeout_s=0.3) is False
        assert 0.25 < time.monotonic() - started < 2
        assert isinstance(await server.recv(), KVRequest)
        abort = await asyncio.wait_for(server.recv(), 2)
        assert isinstance(abort, Abort) and abort.room == 22


@aio
async def test_prefill_failure_reaches_wait_ready() -> None:
    async with prefill() as server, decode_client() as client:
        await client.request_kv(HOST, server.port, kv_request(31))
        req = await server.recv()
        assert isinstance(req, KVRequest) and req.descriptor == b"\x00pool" and req.block_ids == [3, 4]
        assert await server.send_failed(31, "prefill out of memory") is True
        with pytest.raises(HandshakeError) as info:
            await client.wait_ready(31, timeout_s=5)
        assert str(info.value) == f"prefill {HOST}:{server.port} failed room 31: prefill out of memory"
        assert isinstance(info.value, PrefillFailed) and (info.value.code, info.value.image_key) == (None, None)
        assert await server.send_ready(KVReady(room=31, first_token=1, rope_delta=0, prompt_tokens=20)) is False
        assert await client.abort(31, "cleanup", settle_timeout_s=0.1) is True


@aio
async def test_the_prefills_code_and_image_reach_wait_ready_as_typed_fields() -> None:
    key = "ef" * 32
    async with prefill() as server, decode_client() as client:
        await client.request_kv(HOST, server.port, kv_request(32))
        assert isinstance(await server.recv(), KVRequest)
        assert await server.send_failed(32, "The encoder failed on image x", code="encode_failed", image_key=key)
        with pytest.raises(PrefillFailed) as info:
            await client.wait_ready(32, timeout_s=5)
        assert (info.value.room, info.value.code, info.value.image_key) == (32, "encode_failed", key)
        assert str(info.value) == f"prefill {HOST}:{server.port} failed room 32: The encoder failed on image x"
        assert await client.abort(32, "cleanup", settle_timeout_s=0.1) is True


@aio
async def test_a_rejection_carries_the_prefills_code_and_image() -> None:
    key = "0a" * 32
    async with raw_router() as (sock, port), decode_client() as client:
        pending = asyncio.create_task(client.request_kv(HOST, port, kv_request(33)))
        identity, _ = await asyncio.wait_for(sock.recv_multipart(), 5)
        refusal = Rejected(room=33, reason="not cached", code="image_not_cached", image_key=key)
        await sock.send_multipart([identity, encode(refusal)])
        with pytest.raises(PrefillFailed) as info:
            await asyncio.wait_for(pending, 5)
        assert (info.value.code, info.value.image_key) == ("image_not_cached", key)
        assert str(info.value) == f"prefill {HOST}:{port} rejected room 33: not cached"


@aio
async def test_wait_ready_times_out_within_its_deadline() -> None:
    async with prefill() as server, FakePrefill(server) as owner, decode_client() as client:
        await client.request_kv(HOST, server.port, kv_request(41))
        started = time.monotonic()
        expected = r"no KV from prefill .* for room 41 within 0.3 s \(--kv-timeout-s; connected\)"
        with pytest.raises(HandshakeTimeout, match=expected):
            await client.wait_ready(41, timeout_s=0.3)
        assert 0.25 < time.monotonic() - started < 2
        assert await client.abort(41, "timeout") is True  # P acknowledges; blocks are safe
        assert [a.room for a in owner.aborts] == [41]


@aio
async def test_prefill_dies_and_decode_waits_end_with_a_clear_error() -> None:
    async with decode_client() as client:
        server = BootstrapServer(FP, HOST, 0)
        await server.start()
        port = server.port
        for room in (51, 52):
            await client.request_kv(HOST, port, kv_request(room))
        waits = [asyncio.create_task(client.wait_ready(room, timeout_s=3)) for room in (51, 52)]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await server.close()
        for room, wait in zip((51, 52), waits):
            with pytest.raises(HandshakeError) as info:
                await wait
            assert str(info.value) == (
                f"lost connection to prefill {HOST}:{port} (it stopped or crashed) with room {room} in flight"
            )
        assert time.monotonic() - started < 3
        assert await client.abort(51, "prefill died", settle_timeout_s=0.2) is False  # nobody to confirm
        with pytest.raises(BootstrapClosed):
            await server.recv()


@aio
async def test_prefill_not_up_fails_request_within_deadline() -> None:
    async with raw_router() as (_, port):
        pass  # the port is free again: nothing listens there
    async with decode_client() as client:
        started = time.monotonic()
        expected = r"could not send room 61 to prefill .* within 0.3 s \(not connected: is prefill up"
        with pytest.raises(HandshakeTimeout, match=expected):
            await client.request_kv(HOST, port, kv_request(61), accept_timeout_s=0.3)
        assert time.monotonic() - started < 2
        assert client.state(61) is None
        assert await client.abort(61, "cleanup") is True  # never sent: blocks are safe


@aio
async def test_prefill_that_never_answers_fails_request_within_deadline() -> None:
    async with raw_router() as (sock, port), decode_client() as client:
        with pytest.raises(HandshakeTimeout, match=r"did not accept room 62 within 0.3 s \(connected\)"):
            await client.request_kv(HOST, port, kv_request(62), accept_timeout_s=0.3)
        assert await sock.recv_multipart()  # the request did leave: blocks are not safe yet
        assert await client.abort(62, "timeout", settle_timeout_s=0.2) is False


@aio
async def test_server_survives_garbage() -> None:
    async with prefill(max_message_bytes=1 << 16) as server, FakePrefill(server) as owner:
        ctx = zmq.asyncio.Context()
        try:
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(f"tcp://{HOST}:{server.port}")
            for data in GARBAGE:
                await raw.send(data)
            await raw.send_multipart([b"two", b"frames"])
            await raw.send(encode(KVReady(room=1, first_token=1, rope_delta=0, prompt_tokens=1)))  # wrong way
            await raw.send(encode(Abort(room=99, reason="never had it")))
            reply = decode(await asyncio.wait_for(raw.recv(), 5))
            assert reply == KVFailed(room=99, reason="prefill has no room 99 in flight", sent_at=reply.sent_at)
            oversized = ctx.socket(zmq.DEALER)
            oversized.setsockopt(zmq.LINGER, 0)
            oversized.connect(f"tcp://{HOST}:{server.port}")
            await oversized.send(b"\x00" * (1 << 17))  # over MAXMSGSIZE: zmq drops that connection
        finally:
            ctx.destroy(linger=0)
        assert server.bad_frames == len(GARBAGE) + 2
        async with decode_client() as client:  # still serving
            pong = await client.ping(HOST, server.port, timeout_s=5)
            assert pong.fingerprint == FP
            await client.request_kv(HOST, server.port, kv_request(71))
            await owner.http(71)
            assert (await client.wait_ready(71, timeout_s=5)).first_token == first_token(71)


@aio
async def test_ping_times_out_when_nobody_answers() -> None:
    async with raw_router() as (_, port), decode_client() as client:
        with pytest.raises(HandshakeTimeout, match=r"no pong from prefill .* within 0.2 s"):
            await client.ping(HOST, port, timeout_s=0.2)


@aio
async def test_closing_the_client_ends_its_waits() -> None:
    async with prefill() as server:
        client = BootstrapClient()
        await client.request_kv(HOST, server.port, kv_request(81))
        waiter = asyncio.create_task(client.wait_ready(81, timeout_s=5))
        await asyncio.sleep(0)
        await client.close()
        with pytest.raises(HandshakeError, match="decode's bootstrap client closed"):
            await waiter
        with pytest.raises(HandshakeError, match="closed"):
            await client.request_kv(HOST, server.port, kv_request(82))


# ---------------------------------------------------------------------------------------------------
# Peers: the allow-list, the link cap and idle expiry


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nothing listens on (bound all at once, then closed)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def resources() -> tuple[int, int, int]:
    return len(os.listdir("/proc/self/fd")), len(asyncio.all_tasks()), threading.active_count()


async def settled(baseline: tuple[int, int, int], slack: int, timeout_s: float = 5.0) -> tuple[int, int, int]:
    """The counts once each is within ``slack`` of ``baseline`` (libzmq closes sockets in its reaper
    thread), or as they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = resources()
        if all(n <= b + slack for n, b in zip(now, baseline)) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.02)


@pytest.mark.unit
@aio
async def test_disallowed_prefill_is_never_dialed() -> None:
    async with decode_client() as client:
        for host, port in [("10.0.0.1", 8998), ("localhost", 8998), ("127.0.0.1", 0), ("::2", 8998)]:
            with pytest.raises(PeerNotAllowed) as info:
                await client.request_kv(host, port, kv_request(91))
            shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 bracketed
            assert str(info.value) == (
                f"prefill {shown} is not allowed by --allowed-bootstrap (allowed: 127.0.0.0/8, ::1/128)"
            )
            assert isinstance(info.value, HandshakeError) and info.value.room == 91
            with pytest.raises(PeerNotAllowed, match=rf"^prefill {re.escape(shown)} is not allowed"):
                await client.ping(host, port, timeout_s=0.1)
        assert client.links.addresses() == [] and client.state(91) is None
        assert await client.abort(91, "cleanup") is True  # never sent: blocks are safe


@aio
async def test_runtime_registration_allows_then_denies() -> None:
    async with prefill() as server, FakePrefill(server) as owner:
        client = BootstrapClient(allow=AllowList.parse(["prefill-1.rack2:*"]))
        try:
            address = f"{HOST}:{server.port}"
            with pytest.raises(PeerNotAllowed, match=rf"^prefill {address} is not allowed by --allowed-bootstrap "
                                                     r"\(allowed: prefill-1.rack2:\*\)$"):
                await client.request_kv(HOST, server.port, kv_request(92))
            assert client.allow.add(address) is True  # the router registers this prefill
            await client.request_kv(HOST, server.port, kv_request(92))
            await owner.http(92)
            assert (await client.wait_ready(92, timeout_s=5)).first_token == first_token(92)
            assert client.allow.remove(address) is True
            with pytest.raises(PeerNotAllowed):
                await client.request_kv(HOST, server.port, kv_request(93))
            assert client.links.addresses() == [address]  # the open link stays until idle
        finally:
            await client.close()


@aio
async def test_unreachable_prefills_leave_nothing_behind() -> None:
    ports = free_ports(201)
    async with decode_client() as client:
        async def fail(i: int, port: int) -> None:
            with pytest.raises(HandshakeTimeout, match=rf"could not send room {i} to prefill {HOST}:{port} within"):
                await client.request_kv(HOST, port, kv_request(i), accept_timeout_s=0.2)
            assert await client.abort(i, "cleanup") is True

        await fail(0, ports[0])  # warm up: the context's I/O threads and their descriptors
        await asyncio.wait_for(client.links.settle(), 2)
        await asyncio.sleep(0.2)  # libzmq's reaper closes the warm-up link's descriptors
        baseline = resources()
        started = time.monotonic()
        for batch in range(4):
            await asyncio.gather(*(fail(i, ports[i]) for i in range(1 + 50 * batch, 51 + 50 * batch)))
        assert time.monotonic() - started < 10
        assert client.links.addresses() == []  # an idle link that is not connected is closed at once
        fds, tasks, threads = await settled(baseline, slack=2)
        assert (fds - baseline[0] <= 2, tasks, threads) == (True, baseline[1], baseline[2]), (baseline, fds)


@aio
async def test_least_recently_used_idle_link_is_evicted_at_the_cap() -> None:
    async with prefill() as a, prefill() as b, prefill() as c, FakePrefill(a) as owner_a:
        client = BootstrapClient(max_links=2)
        try:
            for server in (a, b, a):
                assert (await client.ping(HOST, server.port, timeout_s=5)).fingerprint == FP
            link_b = client.links.get(f"{HOST}:{b.port}")
            assert link_b is not None and link_b.connected and not link_b.busy
            await client.ping(HOST, c.port, timeout_s=5)
            assert client.links.addresses() == [f"{HOST}:{a.port}", f"{HOST}:{c.port}"]  # b was least recently used
            await asyncio.wait_for(client.links.settle(), 2)
            assert link_b.sock.closed and link_b.monitor.closed and all(t.done() for t in link_b.tasks)

            await client.request_kv(HOST, a.port, kv_request(94))  # a busy, c idle: b's turn evicts c
            await client.ping(HOST, b.port, timeout_s=5)
            assert client.links.addresses() == [f"{HOST}:{a.port}", f"{HOST}:{b.port}"]
            await client.request_kv(HOST, b.port, kv_request(95))  # nobody consumes b.recv(): stays busy
            with pytest.raises(HandshakeError) as info:
                await client.request_kv(HOST, c.port, kv_request(96))
            assert str(info.value) == (
                "decode is talking to too many prefills: all 2 prefill links (max_links) have rooms in flight; "
                "retry when one finishes"
            )
            assert info.value.room == 96 and client.state(96) is None and len(client.links.addresses()) == 2
            await owner_a.http(94)
            await client.wait_ready(94, timeout_s=5)  # a is idle again: c may take its place
            await client.request_kv(HOST, c.port, kv_request(96))
            assert client.links.addresses() == [f"{HOST}:{b.port}", f"{HOST}:{c.port}"]
        finally:
            await client.close()


@aio
async def test_idle_link_expires_and_a_busy_one_does_not() -> None:
    async with prefill() as a, prefill() as b, FakePrefill(b) as owner_b:
        client = BootstrapClient(link_idle_s=0.3)
        try:
            await client.ping(HOST, a.port, timeout_s=5)
            await client.request_kv(HOST, b.port, kv_request(97))
            idle_at = time.monotonic()
            link_a = client.links.get(f"{HOST}:{a.port}")
            assert link_a is not None and link_a.connected and not link_a.busy
            while f"{HOST}:{a.port}" in client.links.addresses() and time.monotonic() - idle_at < 3:
                await asyncio.sleep(0.02)
            assert 0.25 < time.monotonic() - idle_at < 1
            assert client.links.addresses() == [f"{HOST}:{b.port}"]  # b has room 97 in flight
            await asyncio.wait_for(client.links.settle(), 2)
            assert link_a.sock.closed and link_a.monitor.closed

            await asyncio.sleep(0.3)
            assert client.links.addresses() == [f"{HOST}:{b.port}"]
            await owner_b.http(97)
            await client.wait_ready(97, timeout_s=5)
            idle_at = time.monotonic()
            while client.links.addresses() and time.monotonic() - idle_at < 3:
                await asyncio.sleep(0.02)
            assert 0.25 < time.monotonic() - idle_at < 1 and client.links.addresses() == []
            assert client.links._timer is None  # nothing left to expire: no timer armed
            assert (await client.ping(HOST, a.port, timeout_s=5)).fingerprint == FP  # dials again on demand
        finally:
            await client.close()


@pytest.mark.unit
def test_client_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_links must be >= 1, got 0"):
        BootstrapClient(max_links=0)
    with pytest.raises(ValueError, match="link_idle_s must be > 0, got 0"):
        BootstrapClient(link_idle_s=0)
