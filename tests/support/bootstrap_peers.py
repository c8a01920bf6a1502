"""Room-handshake peers for the transfer tests: a model's fingerprint (``FP``), the loopback host,
a decode's KV request for a room, and a bare ZeroMQ ROUTER (``raw_router``) standing in for a
prefill that misbehaves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import zmq
import zmq.asyncio

from transfer.fingerprint import Fingerprint
from transfer.messages import KVRequest

FP = Fingerprint(
    model="qwen2_vl-0123456789abcdef",
    backend="mooncake",
    dtype="bfloat16",
    block_size=16,
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    block_bytes=4 * 2 * 16 * 2 * 64 * 2,
)
HOST = "127.0.0.1"


def kv_request(room: int, fp: Fingerprint = FP, **changes: object) -> KVRequest:
    req = KVRequest(
        room=room, fingerprint=fp, block_ids=[3, 4], prompt_tokens=20, descriptor=b"\x00pool", decode_id="d0"
    )
    return msgspec.structs.replace(req, **changes)


@asynccontextmanager
async def raw_router() -> AsyncIterator[tuple[zmq.asyncio.Socket, int]]:
    """A bare ROUTER standing in for a prefill that misbehaves."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    try:
        yield sock, port
    finally:
        ctx.destroy(linger=0)
