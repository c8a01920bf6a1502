"""The room handshake's liveness, with real ZeroMQ endpoints over 127.0.0.1: a prefill holding a room
sends ``Heartbeat`` frames, so a decode waiting for its KV tells a slow prefill (kept, however long
past the idle bound, within the total one) from a silent one (failed once silent for the idle bound).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import zmq
import zmq.asyncio

from transfer.bootstrap_client import BootstrapClient
from transfer.bootstrap_common import HandshakeTimeout
from transfer.bootstrap_server import BootstrapServer
from transfer.messages import Accepted, Heartbeat, KVReady, KVRequest, decode, encode
from tests.support.bootstrap_peers import FP, HOST, kv_request
from tests.support.bootstrap_peers import raw_router as mute_prefill  # a bare ROUTER that accepts rooms and says nothing

pytestmark = pytest.mark.timeout(30)
aio = pytest.mark.asyncio
IDLE_S = 0.6
BEAT_S = 0.1


@asynccontextmanager
async def endpoints(heartbeat_s: float = BEAT_S) -> AsyncIterator[tuple[BootstrapServer, BootstrapClient]]:
    server = BootstrapServer(FP, HOST, 0, heartbeat_s=heartbeat_s)
    client = BootstrapClient()
    await server.start()
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


@aio
async def test_a_slow_prefill_that_beats_is_not_cut_by_the_idle_bound() -> None:
    """The owner holds the room 3x the idle bound before answering; the heartbeats keep it."""
    async with endpoints() as (server, client):
        await client.request_kv(HOST, server.port, kv_request(11))
        request = await asyncio.wait_for(server.recv(), 5)
        assert isinstance(request, KVRequest) and request.room == 11
        wait = asyncio.create_task(client.wait_ready(11, timeout_s=10, idle_timeout_s=IDLE_S))
        await asyncio.sleep(3 * IDLE_S)  # the slow prefill's forward pass and write
        assert not wait.done()
        assert await server.send_ready(KVReady(room=11, first_token=5, rope_delta=0, prompt_tokens=20))
        ready = await asyncio.wait_for(wait, 5)
        assert (ready.room, ready.first_token) == (11, 5)
        assert server.heartbeats_sent >= 3 * IDLE_S / BEAT_S / 2


@aio
async def test_a_silent_prefill_fails_the_room_at_the_idle_bound_not_the_total() -> None:
    async with mute_prefill() as (sock, port):
        client = BootstrapClient()
        try:
            sent = asyncio.create_task(client.request_kv(HOST, port, kv_request(12)))
            identity, frame = await asyncio.wait_for(sock.recv_multipart(), 5)
            assert decode(frame).room == 12
            await sock.send_multipart([identity, encode(Accepted(room=12))])
            await asyncio.wait_for(sent, 5)
            started = time.monotonic()
            with pytest.raises(HandshakeTimeout) as info:
                await client.wait_ready(12, timeout_s=20, idle_timeout_s=IDLE_S)
            elapsed = time.monotonic() - started
            assert IDLE_S - 0.05 < elapsed < IDLE_S + 1.0, elapsed
            assert str(info.value).startswith(f"prefill {HOST}:{port} went silent with room 12 in flight: nothing "
                                              "from it for ")
            assert str(info.value).endswith(" s (--peer-idle-timeout-s 0.6; it stopped, hung or became unreachable)")
        finally:
            await client.close()


@aio
async def test_a_heartbeat_for_another_room_or_decode_keeps_nothing_alive() -> None:
    """Silence is per room: beats naming other rooms do not count for this one."""
    async with mute_prefill() as (sock, port):
        client = BootstrapClient()
        try:
            sent = asyncio.create_task(client.request_kv(HOST, port, kv_request(13)))
            identity, _ = await asyncio.wait_for(sock.recv_multipart(), 5)
            await sock.send_multipart([identity, encode(Accepted(room=13))])
            await asyncio.wait_for(sent, 5)

            async def beat_others() -> None:
                while True:
                    await sock.send_multipart([identity, encode(Heartbeat(rooms=[14, 15]))])
                    await asyncio.sleep(BEAT_S)

            beating = asyncio.create_task(beat_others())
            try:
                started = time.monotonic()
                with pytest.raises(HandshakeTimeout, match="went silent with room 13 in flight"):
                    await client.wait_ready(13, timeout_s=20, idle_timeout_s=IDLE_S)
                assert time.monotonic() - started < IDLE_S + 1.0
            finally:
                beating.cancel()
        finally:
            await client.close()


@aio
async def test_beats_name_the_rooms_held_for_that_decode_and_stop_once_answered() -> None:
    async with mute_decode_pair() as (server, dealer):
        for room in (21, 22):
            await dealer.send(encode(kv_request(room)))
            assert await _next(dealer) == Accepted(room=room)
        beat = await _next_heartbeat(dealer)
        assert sorted(beat.rooms) == [21, 22]
        await server.send_failed(21, "done")
        assert type(await _next(dealer)).__name__ == "KVFailed"
        beat = await _next_heartbeat(dealer)
        assert beat.rooms == [22]
        await server.send_ready(KVReady(room=22, first_token=1, rope_delta=0, prompt_tokens=20))
        assert type(await _next(dealer)).__name__ == "KVReady"
        sent = server.heartbeats_sent
        await asyncio.sleep(5 * BEAT_S)
        assert server.heartbeats_sent == sent  # nothing held: nothing to beat for


@pytest.mark.unit
def test_a_heartbeat_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="heartbeat_s must be > 0, got 0"):
        BootstrapServer(FP, HOST, 0, heartbeat_s=0)


@asynccontextmanager
async def mute_decode_pair() -> AsyncIterator[tuple[BootstrapServer, zmq.asyncio.Socket]]:
    server = BootstrapServer(FP, HOST, 0, heartbeat_s=BEAT_S)
    await server.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{HOST}:{server.port}")
    try:
        yield server, dealer
    finally:
        ctx.destroy(linger=0)
        await server.close()


async def _next(dealer: zmq.asyncio.Socket) -> object:
    """The next frame that is not a ``Heartbeat``, with ``sent_at`` zeroed."""
    while True:
        msg = decode(await asyncio.wait_for(dealer.recv(), 5))
        if not isinstance(msg, Heartbeat):
            return msgspec.structs.replace(msg, sent_at=0.0)


async def _next_heartbeat(dealer: zmq.asyncio.Socket) -> Heartbeat:
    while True:
        msg = decode(await asyncio.wait_for(dealer.recv(), 5))
        if isinstance(msg, Heartbeat):
            return msg
