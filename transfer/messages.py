"""Wire messages of the room handshake between a decode server (D) and a prefill server (P).

Every message is a small frozen msgspec ``Struct`` in one tagged union, serialized as msgpack by one
codec (``encode`` / ``decode``). Nothing here is pickled and nothing is decoded by position: a frame
is a msgpack map whose ``type`` key names the struct, so fields can be added with defaults without
breaking older peers of the same protocol version (msgspec ignores a field it does not know and fills
a missing one from its default; ``Rejected.code`` / ``image_key`` and ``KVFailed``'s were added so,
within version 1; so were ``KVReady``'s ``first_tokens``, ``first_logprobs`` and ``prompt_logprobs``
for issue 19's ``n`` and logprobs: an older decode reads ``first_token``, sequence 0's, and ignores
them, and a newer decode finds them empty in an older prefill's frame and refuses a request that needed
them, ``check_ready``).

Grouped by the process that receives them:

- to prefill (sent by D's ``BootstrapClient``): ``KVRequest``, ``Abort``, ``Ping``;
- to decode (sent by P's ``BootstrapServer``): ``Accepted``, ``Rejected``, ``KVReady``, ``KVFailed``,
  ``Pong``, ``Heartbeat``.

Version 2 added ``Heartbeat``: P sends one to each decode every ``--peer-heartbeat-s`` naming the
rooms it holds for that decode, and a version 2 decode fails a room whose prefill has been silent
for ``--peer-idle-timeout-s``. A version 1 prefill never sends one (a version 2 decode would cut
every room longer than its idle timeout), so the version changed rather than the frame being added
within version 1.

Every message carries ``version`` (``PROTOCOL_VERSION`` of the sender) and ``sent_at`` (sender's
wall clock, seconds since the epoch; 0.0 when unset), which the endpoints fill in on send. A
``KVRequest`` also carries D's ``Fingerprint``; P refuses a request whose version or fingerprint
differs, with an error that names the setting to change (``transfer.fingerprint``).
"""

from __future__ import annotations

from typing import Union

import msgspec

from contract.bootstrap import ROOM_MAX
from transfer.fingerprint import Fingerprint, check_compatible, check_version

PROTOCOL_VERSION = 2  # 2: Heartbeat (P's liveness while it holds a room)


class ProtocolError(Exception):
    """A frame that is not a valid message of this protocol (garbled, unknown type, bad fields)."""


class VersionMismatch(ProtocolError):
    """A frame from a peer that speaks another protocol version.

    ``room`` is the frame's room when it could be read (so the receiver can answer for that room),
    else None.
    """

    def __init__(self, peer_version: int, room: int | None) -> None:
        super().__init__(f"peer speaks protocol version {peer_version}, this process {PROTOCOL_VERSION}")
        self.peer_version = peer_version
        self.room = room


# ---------------------------------------------------------------------------------------------------
# Messages


class _Message(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    version: int = PROTOCOL_VERSION
    sent_at: float = 0.0


# To prefill ------------------------------------------------------------------------------------------


class KVRequest(_Message, frozen=True, kw_only=True):
    """D has reserved ``block_ids`` for room ``room`` and asks P to write the prompt's KV into them.

    ``descriptor`` is opaque here: the transfer backend's description of D's registered KV pool (its
    address and memory handle). ``prompt_tokens`` is D's prompt length; P checks that the blocks hold
    it and, once it has built its own prompt, that both lengths agree. ``decode_id`` names the D
    process in logs and timelines.

    ``cached_blocks``: the prompt's first blocks D has in its own prefix cache already; ``block_ids``
    then start at the prompt's block ``cached_blocks`` and P writes only its blocks from there. An
    older P (no such field) finds ``block_ids`` too few for the prompt and refuses the room, so it
    never writes into D's cached blocks.

    ``traceparent``: D's W3C ``traceparent`` for the room (its request's span, ``stages.tracing``), None
    when D traces nothing. A P whose own HTTP half came without one records the room's spans under it,
    so the room's prefill and decode spans share one trace. Optional within version 1 and 2: an older
    P ignores it, an older D sends none.
    """

    room: int
    fingerprint: Fingerprint
    block_ids: list[int]
    prompt_tokens: int
    descriptor: bytes
    decode_id: str
    cached_blocks: int = 0
    traceparent: str | None = None


class Abort(_Message, frozen=True, kw_only=True):
    """D gives up on ``room`` (client disconnect, timeout). P stops and answers with ``KVFailed``."""

    room: int
    reason: str


class Ping(_Message, frozen=True, kw_only=True):
    """Health probe; P answers ``Pong`` with the same nonce."""

    nonce: int


# To decode -------------------------------------------------------------------------------------------


class Accepted(_Message, frozen=True, kw_only=True):
    """P validated D's ``KVRequest`` for ``room`` and will answer it with ``KVReady`` or ``KVFailed``."""

    room: int


class Rejected(_Message, frozen=True, kw_only=True):
    """P refused D's ``KVRequest``; P will not touch D's blocks for ``room``.

    ``reason`` is prose for people. ``code`` and ``image_key`` are the typed fields of P's failure
    (the error code and, for an image's failure in EPD, its content key; docs/protocol.md "Typed
    error fields"), None when P has none: its own validation refusals (version, fingerprint, blocks,
    full) have no code. Optional with defaults, so frames with or without them decode on either side
    of one protocol version (an older peer ignores them; a newer one reads None from an older)."""

    room: int
    reason: str
    code: str | None = None
    image_key: str | None = None


class Logprob(msgspec.Struct, frozen=True, array_like=True):
    """One position's log-probabilities on the wire: the token there, its log-probability and the
    ``k`` most likely (token id, logprob), most likely first. The same msgpack array as the engine's
    ``stages.engine.logprobs.TokenLogprob`` (``[token_id, logprob, [[id, lp], ...]]``), which this
    package cannot import; each side converts at its edge."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class KVReady(_Message, frozen=True, kw_only=True):
    """P has written the whole prompt's KV into D's blocks; D may start decoding ``room``.

    ``first_token`` is the token P sampled from the prompt (sequence 0's); ``rope_delta`` is the
    per-request M-RoPE position delta (0 for models without M-RoPE); ``prompt_tokens`` is P's prompt
    length; ``cached_tokens`` how many of them P found in its prefix cache (D reports it in its usage).

    For a request of ``n`` sequences, ``first_tokens`` holds all n first tokens (sequence i's at i;
    ``first_tokens[0] == first_token``), empty from a prefill that predates it (then only
    ``first_token``: ``tokens()``). ``first_logprobs`` (when the request asked for ``logprobs``): one
    per first token. ``prompt_logprobs`` (when it asked for them): one per prompt position, position
    0 None. All optional with defaults, so either side of one protocol version reads the other's
    frames; ``check_ready`` says whether one carries what a request needs, ``ready_bytes_bound``
    how big one can get.
    """

    room: int
    first_token: int
    rope_delta: int
    prompt_tokens: int
    cached_tokens: int = 0
    first_tokens: list[int] = []
    first_logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None

    def tokens(self) -> list[int]:
        """The first token of every sequence (an older prefill's frame: ``[first_token]``)."""
        return self.first_tokens or [self.first_token]


class KVFailed(_Message, frozen=True, kw_only=True):
    """P failed ``room`` (or acknowledges D's ``Abort``); P no longer writes into D's blocks.

    ``code`` and ``image_key``: the typed fields of P's failure, as P answers its own client (e.g.
    ``encode_failed`` and the image's key), None when unknown; optional as in ``Rejected``."""

    room: int
    reason: str
    code: str | None = None
    image_key: str | None = None


class Pong(_Message, frozen=True, kw_only=True):
    """Answer to ``Ping``; carries P's fingerprint so D can check compatibility before any request."""

    nonce: int
    fingerprint: Fingerprint


class Heartbeat(_Message, frozen=True, kw_only=True):
    """P is alive and still holds ``rooms`` for this decode (accepted, not yet answered with
    ``KVReady`` or ``KVFailed``): sent every ``--peer-heartbeat-s`` while it holds any, whatever
    the room is doing (queued, prefilling, writing). D counts a room's silence from the last frame
    that named it and fails the room past ``--peer-idle-timeout-s`` (its prefill's host vanished, or
    the process stopped); a slow but live prefill is never cut by it."""

    rooms: list[int]


ToPrefill = Union[KVRequest, Abort, Ping]
ToDecode = Union[Accepted, Rejected, KVReady, KVFailed, Pong, Heartbeat]
Message = Union[ToPrefill, ToDecode]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One frame for ``msg``."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """The message in ``data``.

    Raises ``VersionMismatch`` for a frame of another protocol version (even one whose fields this
    version cannot parse) and ``ProtocolError`` for anything else that is not a valid message.
    """
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        _raise_if_other_version(data)
        raise ProtocolError(f"invalid frame ({len(data)} bytes): {e}") from None
    if msg.version != PROTOCOL_VERSION:
        raise VersionMismatch(msg.version, getattr(msg, "room", None))
    return msg


def _raise_if_other_version(data: bytes) -> None:
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return
    if not isinstance(raw, dict):
        return
    version, room = raw.get("version"), raw.get("room")
    if isinstance(version, int) and version != PROTOCOL_VERSION:
        valid_room = isinstance(room, int) and 0 <= room <= ROOM_MAX
        raise VersionMismatch(version, room if valid_room else None)


def check_kv_request(req: KVRequest, mine: Fingerprint) -> str | None:
    """None when P can serve ``req``, else why not (the ``Rejected`` reason). Pure; no state."""
    if reason := check_version(PROTOCOL_VERSION, req.version):
        return reason
    if reason := check_compatible(mine, req.fingerprint):
        return reason
    if not 0 <= req.room <= ROOM_MAX:
        return f"room {req.room} is not a 63-bit non-negative int"
    if req.prompt_tokens <= 0:
        return f"prompt_tokens must be > 0, got {req.prompt_tokens}"
    if any(b < 0 for b in req.block_ids) or len(set(req.block_ids)) != len(req.block_ids):
        return "block_ids must be distinct non-negative ints"
    if not 0 <= req.cached_blocks < -(-req.prompt_tokens // mine.block_size):
        return (f"cached_blocks must leave the prompt's last block to write: {req.cached_blocks} of a "
                f"{req.prompt_tokens}-token prompt's blocks of {mine.block_size} tokens")
    capacity = (req.cached_blocks + len(req.block_ids)) * mine.block_size
    if capacity < req.prompt_tokens:
        return (
            f"decode reserved {len(req.block_ids)} blocks of {mine.block_size} tokens "
            f"({capacity} slots{f' with {req.cached_blocks} cached' if req.cached_blocks else ''}) "
            f"for a {req.prompt_tokens}-token prompt"
        )
    return None


# Bytes of one ``Logprob`` with ``k`` top entries at most: array header 1, token id (uint32) 5, float64 9,
# top's header 3, each (id, logprob) pair 1 + 5 + 9.
_LOGPROB_BYTES, _TOP_BYTES = 18, 15
_READY_BASE_BYTES = 256  # KVReady's tag, scalars and field names


def ready_bytes_bound(*, n: int, logprobs: int | None, prompt_tokens: int, prompt_logprobs: int | None) -> int:
    """An upper bound on the encoded size of the ``KVReady`` of a request of ``n`` sequences asking
    for ``logprobs`` (k, or None) and ``prompt_logprobs`` (k, or None) of a ``prompt_tokens`` prompt
    (pure). The frame must fit the peer's ``max_message_bytes``: the prompt's logprobs are what can
    grow, 18 + 15 k bytes per prompt token."""
    size = _READY_BASE_BYTES + n * 10
    if logprobs is not None:
        size += n * (_LOGPROB_BYTES + _TOP_BYTES * logprobs)
    if prompt_logprobs is not None:
        size += 5 + prompt_tokens * (_LOGPROB_BYTES + _TOP_BYTES * prompt_logprobs)
    return size


def check_ready(ready: KVReady, *, n: int, logprobs: int | None, prompt_tokens: int,
                prompt_logprobs: int | None) -> str | None:
    """None when ``ready`` carries what D's request needs (``n`` first tokens; their logprobs with at
    most ``logprobs`` top entries each when asked; the prompt's logprobs, one per position, when
    asked), else what is missing or wrong (pure). A prefill of an older release sends one first
    token and no logprobs: a request that needs more fails with this reason rather than decoding
    without them."""
    old = "; run the same release on prefill and decode"
    tokens = ready.tokens()
    if len(tokens) != n or tokens[0] != ready.first_token:
        return f"the prefill sent {len(tokens)} first token(s) for a request of n={n}{old}"
    if logprobs is not None:
        if ready.first_logprobs is None or len(ready.first_logprobs) != n:
            got = "none" if ready.first_logprobs is None else len(ready.first_logprobs)
            return f"the prefill sent {got} first-token logprobs for a request of n={n} asking for logprobs{old}"
        for token, lp in zip(tokens, ready.first_logprobs):
            if lp.token_id != token or len(lp.top) > logprobs:
                return (f"the prefill's first-token logprobs do not match its first tokens or the {logprobs} "
                        f"top logprobs asked")
    if prompt_logprobs is not None:
        got_prompt = ready.prompt_logprobs
        if got_prompt is None or len(got_prompt) != prompt_tokens or (prompt_tokens and got_prompt[0] is not None):
            got = "none" if got_prompt is None else len(got_prompt)
            return (f"the prefill sent {got} prompt logprobs for a {prompt_tokens}-token prompt asking for "
                    f"them (position 0 None){old}")
        if any(lp is None or len(lp.top) > prompt_logprobs for lp in got_prompt[1:]):
            return f"the prefill's prompt logprobs lack a position or exceed the {prompt_logprobs} top asked"
    return None
