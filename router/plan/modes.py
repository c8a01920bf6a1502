"""Who gets what, per mode: a ``Plan`` names the stage that answers the client and the side calls that
must succeed for it to (the prefill in pd mode), each with the exact body it is sent.

Each stage gets the route the client called (``Call.path``: chat, or ``/v1/completions``, text only).

    colocated   one worker, the client's body
    pd          one decode and one compatible prefill, one fresh room; the decode gets the body with
                bootstrap_host/port/room, the prefill the same with ``stream: false`` (its answer
                is for the router)

The bodies are the client's bytes with the bootstrap fields spliced in before the closing brace
(``splice``), not the parsed body encoded again: one copy of the bytes per stage, no re-encoding,
and for a non-stream request the prefill and the decode share one body. The parsed body is encoded
only when the bytes cannot be used as they are: the client sent bootstrap fields of its own (they
are replaced), the router rewrote the body (a fetched image, epd's image references: ``Call.raw``
is None), or, for the prefill alone, the client asked for a stream (``stream`` and
``stream_options`` are rewritten, and duplicate keys are never sent).

    epd         the pd plan of the body with image references, plus one encoder side call per
                encoder that gets missing images (``router.plan.epd.EPDPlanner``: it reads the cache,
                so planning is a coroutine in every mode)
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import msgspec

from contract.bootstrap import BOOTSTRAP_FIELDS
from contract.paths import CHAT_PATH
from router.errors import no_allowed_pair, no_worker
from router.fleet.pairing import Pairing
from router.plan.prefix_tree import Prefix, chat_units, prompt_units, url_key
from router.fleet.workers import Pool, Worker, compatible, has_pair, pick_pair
from telemetry import NO_SPAN, Span

if TYPE_CHECKING:
    from router.plan.image_refs import RefImage
    from router.plan.videos import RefVideo

LOCAL_ENCODE = "local_encode"  # the label of an encode call a prefill serves for its own request
NO_IMAGES: Mapping[str, str] = MappingProxyType({})  # a plan's ``images`` without any (read-only: shared)
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Call:
    """One client request: the body (images already resolved to data: URLs) and what the router reads of it."""

    body: dict
    stream: bool
    model: str | None
    started: float  # arrival, time.perf_counter()
    images: tuple[RefImage, ...] = ()  # epd: the body's image parts with their keys and sizes
    path: str = CHAT_PATH  # the route the client called: every stage of the plan gets the same (COMPLETIONS_PATH)
    raw: bytes | None = None  # the client's bytes, when ``body`` is exactly what they decode to (else None)
    # the body's video parts, checked and planned (epd: with their keys); none when the stages publish no video
    videos: tuple[RefVideo, ...] = ()
    span: Span = NO_SPAN  # the request's span when the router traces (``router.dispatch.trace``)

    @property
    def media(self) -> tuple[RefImage | RefVideo, ...]:
        """The parts sent as references (epd): images, then videos."""
        return (*self.images, *self.videos)

    @cached_property
    def prefix(self) -> Prefix:
        """The body's routing units (``router.plan.prefix_tree``), for prefix_aware: computed when it first
        reads them. A video weighs its planned tokens (as characters), under its reference's key and its URL's."""
        if self.path != CHAT_PATH:
            return Prefix.of(prompt_units(self.body))
        weights = {unit: video.weight for video in self.videos
                   for unit in (video.key, url_key(video.url)) if unit is not None}
        return Prefix.of(chat_units(self.body, weights))


@dataclass(frozen=True)
class Target:
    stage: str  # encoder, prefill, decode, colocated
    worker: Worker
    body: bytes
    path: str = CHAT_PATH
    headers: bytes = b""  # extra header lines, each ending in CRLF: the call's ``traceparent`` when traced


@dataclass(frozen=True)
class Plan:
    answer: Target  # streams or returns the client's answer
    sides: tuple[Target, ...] = ()  # must succeed; their answers are for the router
    room: int | None = None
    # epd: each image key -> the URL of the encoder it was sent to, "" if not sent (``verdict.blame_encoder``)
    images: Mapping[str, str] = field(default_factory=lambda: NO_IMAGES)
    cached: frozenset[str] = frozenset()  # epd: the image keys the cache held when the plan was made
    local_encode: bool = False  # epd: the missing images went to the prefill itself (router.plan.local_encode)
    # epd: called once if the attempt ends without success, with the URLs it could not reach; it
    # tells the plan's encoders to drop the room's work (closing a connection does not)
    on_abort: Callable[[frozenset[str]], Awaitable[None]] | None = None

    def label(self, target: Target) -> str:
        """``target``'s stage as the room log, ``x-epd-stage-times`` and ``epd_router_stage_seconds`` name
        it: ``local_encode`` for the encode call sent to the prefill itself, else its stage."""
        return LOCAL_ENCODE if self.local_encode and target.stage == "encoder" else target.stage

    @property
    def partner(self) -> Target | None:
        """The side call whose failure the answering stage reports as a peer failure (the prefill)."""
        return next((side for side in self.sides if side.stage == "prefill"), None)


class Planner(Protocol):
    async def plan(self, call: Call, exclude: Collection[str]) -> Plan:
        """The targets of one attempt, none of them in ``exclude`` (URLs). RouterError (503) when no
        eligible worker is left."""
        ...


class ColocatedPlanner:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def plan(self, call: Call, exclude: Collection[str]) -> Plan:
        candidates = self.pool.candidates(call.model, exclude)
        if not candidates:
            raise no_worker("colocated", call.model)
        body = call.raw if call.raw is not None else _encode(call.body)
        return Plan(Target("colocated", self.pool.pick(candidates, context=call), body, call.path))


class PDPlanner:
    def __init__(self, prefills: Pool, decodes: Pool, pairing: Pairing | None = None) -> None:
        self.prefills = prefills
        self.decodes = decodes
        self.pairing = pairing or Pairing()

    async def plan(self, call: Call, exclude: Collection[str]) -> Plan:
        pair = pick_pair(self.prefills, self.decodes, call.model, exclude, self.pairing.pairable, call)
        if pair is None:
            if has_pair(self.prefills, self.decodes, call.model, exclude, compatible):
                raise no_allowed_pair(self.pairing.rules.describe())
            role = "decode" if self.prefills.candidates(call.model, exclude) else "prefill"
            raise no_worker(role, call.model)
        prefill, decode = pair
        assert prefill.bootstrap is not None  # compatible() requires discovered prefills
        room = new_room()
        host, port = prefill.bootstrap
        decode_body, prefill_body = pd_bodies(call, host, port, room)
        return Plan(Target("decode", decode, decode_body, call.path),
                    (Target("prefill", prefill, prefill_body, call.path),), room)


def pd_bodies(call: Call, host: str, port: int, room: int) -> tuple[bytes, bytes]:
    """(the decode's body, the prefill's body): the client's with ``bootstrap_host/port/room`` (any the
    client sent replaced), the prefill's with ``stream: false`` and no ``stream_options``. Spliced
    into ``call.raw`` where it can be (see the module doc); the same bytes object for both when the
    two bodies are equal."""
    body = call.body
    raw = call.raw
    if raw is None or any(k in body for k in BOOTSTRAP_FIELDS):
        fields = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
        fields.update(zip(BOOTSTRAP_FIELDS, (host, port, room)))
        decode_body = _encode(fields)
        if body.get("stream", False) is False and "stream_options" not in body and "stream" in body:
            return decode_body, decode_body
        fields.pop("stream_options", None)
        fields["stream"] = False
        return decode_body, _encode(fields)
    spliced = b'"bootstrap_host":%b,"bootstrap_port":%d,"bootstrap_room":%d' % (_encode(host), port, room)
    empty = not body
    decode_body = splice(raw, spliced, empty)
    if "stream_options" not in body:
        if "stream" not in body:
            return decode_body, splice(raw, spliced + b',"stream":false', empty)
        if body["stream"] is False:
            return decode_body, decode_body
    prefill = {k: v for k, v in body.items() if k != "stream_options"}
    prefill.update(zip(BOOTSTRAP_FIELDS, (host, port, room)), stream=False)
    return decode_body, _encode(prefill)


def splice(raw: bytes, members: bytes, empty: bool = False) -> bytes:
    """``raw`` (the bytes of a JSON object; ``empty``: it has no members) with ``members`` (``"key":value``
    pairs, comma-separated) added before its closing brace; one copy of ``raw``."""
    end = raw.rfind(b"}")  # only whitespace follows the closing brace
    return b"".join((memoryview(raw)[:end], members if empty else b"," + members, b"}"))


ROOM_BATCH = 256  # room ids drawn per os.urandom call (one getrandom syscall for this many requests)
_rooms: list[int] = []


def new_room() -> int:
    """A random 63-bit room id (the stages accept [0, ``contract.bootstrap.ROOM_MAX``]), from the OS's CSPRNG as
    ``secrets.randbits`` draws them, ``ROOM_BATCH`` at a time."""
    if not _rooms:
        data = os.urandom(8 * ROOM_BATCH)
        _rooms.extend(int.from_bytes(data[i:i + 8], "little") >> 1 for i in range(0, len(data), 8))
    return _rooms.pop()
