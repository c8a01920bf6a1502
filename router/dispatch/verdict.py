"""What went wrong in one attempt, and whose fault it was. Pure.

A ``Failure`` is one stage's failure as the router saw it: an HTTP error answer, an in-band error
event before anything reached the client, a connection it could not open or lost, or a deadline.
``blame`` decides which stage an attempt's failure is charged to: the breaker of that worker
counts it, a retry avoids it, and the client's error names it.

What a stage's error is about is read from its body's typed fields (``contract.errors.TYPED_FIELDS`` inside
``error``: ``stage``, ``room``, ``image_key``, ``peer_code``, with ``code``), never from its message:
the message is prose for people, and rewording it changes nothing here (docs/protocol.md "Typed
error fields").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from contract.claims import RETRY_AFTER_S
from contract.errors import Blame, Code, blaming, rule_of

# a stage's error codes that say its partner stage (not itself) failed or never came
PEER_CODES = blaming(Blame.PEER)
# a prefill's error codes about writing into its decode: with the decode's own call silent, the decode
# (frozen, or its host gone) is the likelier culprit (``router.dispatch.dispatcher._decode_behind``)
DECODE_SIDE_CODES = blaming(Blame.PEER, Blame.DECODE)
# a stage's 4xx codes that are about the router's choices (room, pair), not the request: retried, no breaker charge
ROUTER_CODES = blaming(Blame.ROUTER)
# a stage's error codes about a dependency every worker shares (epd: the Redis of the embedding cache):
# another worker would fail the same way, so the request is not retried and no breaker is charged
SHARED_CODES = blaming(Blame.SHARED)
# a prefill's error codes about one image's embedding (its ``image_key`` field names the image): the
# encoder's failure, the encode given up unfinished, or the cache's answer the router planned on going stale (epd)
IMAGE_CODES = blaming(Blame.ENCODER)
# a stage's codes that say it is shutting down (SIGTERM; docs/protocol.md "Draining"): ``draining`` refused
# the request before taking any of it, ``drain_timeout`` aborted it at the stage's --shutdown-grace-s. Not a
# fault: no breaker charge, the worker out of rotation at once (the health loop re-admits it if it comes
# back healthy), and, before anything reached the client, retried on another worker
LEAVING_CODES = blaming(Blame.LEAVING)


@dataclass(frozen=True)
class Failure:
    stage: str  # encoder, prefill, decode or colocated
    url: str
    status: int  # the stage's status; 502 when unreachable, 504 on the router's deadline
    message: str
    code: str | None = None
    raw: bytes | None = None  # the stage's own error body, forwarded as-is for a client error
    unreachable: bool = False  # no connection, or it was lost: mark the worker unhealthy at once
    retry_after: str | None = None  # the stage's Retry-After header
    room: int | None = None  # the error body's ``room`` field: the bootstrap room it is about
    image_key: str | None = None  # the error body's ``image_key`` field: the image it is about
    peer_code: str | None = None  # the error body's ``peer_code`` field: a decode's prefill's own code

    @property
    def busy(self) -> bool:
        """A 503 with ``Retry-After``: the stage is at its limits and refused the request before
        taking any of it (back-pressure, not a fault): no breaker charge, the worker stays healthy,
        another worker may take it; when none can, the client gets the 503 with ``Retry-After``."""
        return self.status == 503 and self.retry_after is not None

    @property
    def leaving(self) -> bool:
        """The stage is shutting down (``LEAVING_CODES``): it is taken out of rotation, not blamed."""
        return self.code in LEAVING_CODES

    @property
    def refused(self) -> bool:
        """The stage took none of the request: busy (503 with Retry-After) or draining."""
        return self.busy or self.code == Code.DRAINING

    @property
    def client_fault(self) -> bool:
        """The request is wrong (4xx): answer the client, retry nothing, blame no worker. A room
        conflict (the router's bad luck with a random number) and a decode refusing to dial the
        prefill the router chose are the router's doing, not the client's (``ROUTER_CODES``)."""
        return 400 <= self.status < 500 and self.code not in ROUTER_CODES


def from_answer(stage: str, url: str, status: int, raw: bytes, retry_after: str | None = None) -> Failure:
    """A non-2xx answer (``retry_after``: its Retry-After header); its OpenAI error body, if any,
    gives the message, the code and the typed fields."""
    error = _error_of(raw)
    message = error.get("message") if isinstance(error.get("message"), str) else raw[:200].decode(errors="replace")
    return Failure(stage, url, status, message or f"HTTP {status}", _text(error, "code"), raw, retry_after=retry_after,
                   room=_room(error), image_key=_text(error, "image_key"), peer_code=_text(error, "peer_code"))


def from_event(stage: str, url: str, body: dict) -> Failure:
    """An in-band error event (``{"error": {...}}``) that came before anything reached the client."""
    error = body.get("error")
    if not isinstance(error, dict):
        error = {}
    code = _text(error, "code")
    message = error.get("message")
    if not isinstance(message, str):
        message = "error event without a message"
    return Failure(stage, url, _event_status(code), message, code, room=_room(error),
                   image_key=_text(error, "image_key"), peer_code=_text(error, "peer_code"))


def unreachable(stage: str, url: str, detail: str) -> Failure:
    return Failure(stage, url, 502, f"{url} could not be reached or went away: {detail}", Code.UPSTREAM_UNAVAILABLE,
                   unreachable=True)


def timed_out(stage: str, url: str, deadline_s: float, flag: str) -> Failure:
    return Failure(stage, url, 504, f"{url} did not answer within {deadline_s:g} s ({flag})", Code.UPSTREAM_TIMEOUT)


def idle(stage: str, url: str, idle_s: float) -> Failure:
    """An open stream that sent no byte, keep-alives included, for ``idle_s``: the stage (or its host)
    is stalled or gone. Marked unreachable: the worker is unhealthy until its /health answers again."""
    return Failure(stage, url, 504, f"{url} sent nothing for {idle_s:g} s on an open stream, keep-alives included "
                                    "(--stream-idle-timeout-s)", Code.UPSTREAM_IDLE_TIMEOUT, unreachable=True)


def blame(answer: Failure, partner: tuple[str, str] | None) -> Failure:
    """The failure to act on when the answering stage failed before the client got anything.
    ``partner``: (stage, url) of the answering stage's partner (the prefill that feeds a decode)
    if its own call has not answered yet, else None. When the answering stage says its partner
    failed or never came (or a prefill, that writing into its decode failed) and the partner has not
    answered, the partner is to blame; otherwise the answering stage is. (A partner that failed on its own call is seen, and blamed, at once.)

    The partner's failure keeps the answer's ``room`` and ``image_key``, and its code is the
    partner's own as the answer reports it (``peer_code``), else the answer's: a decode whose prefill
    failed on an image (``encode_failed`` ...) is then charged by ``blame_encoder`` as the prefill's
    own answer would be, even when the decode's answer comes first."""
    if partner is not None and (answer.code in PEER_CODES
                                or (answer.stage == "prefill" and answer.code in DECODE_SIDE_CODES)):
        stage, url = partner
        return Failure(stage, url, answer.status, f"the {answer.stage} stage reports: {answer.message}",
                       answer.peer_code or answer.code, room=answer.room, image_key=answer.image_key)
    return answer


def blame_encoder(failure: Failure, images: Mapping[str, str]) -> Failure:
    """EPD: a prefill's failure about an image the router put in this attempt, charged to the encoder.

    ``images``: each image key of the attempt -> the URL of the encoder it was sent to, or "" when
    it was not sent (cached, or being encoded elsewhere, when the attempt was planned). The image is
    the one the failure's ``image_key`` field names (never read from the message). Sent: that
    encoder is to blame (its breaker, its exclusion from a retry). Not sent: nobody here is, but the
    attempt is retried (status 502, not the client's fault): a fresh plan reads the cache again.
    Back-pressure (503 with Retry-After, retried, nobody charged), as nothing is wrong with the image
    or any encoder (``contract.claims``): an encode abandoned unfinished (``encode_abandoned``), and a
    key neither cached nor claimed when the prefill looked (``image_not_cached``: the claim the plan
    counted on, this attempt's or another request's, lapsed or ended first; an encoder that failed
    on it says so in its own answer, which ``dispatcher._encoder_behind`` prefers; told to the client
    as ``encode_abandoned``, as the prefill's own advice is for a client of its own).
    Any other failure, or a key the router did not put there (a client's own ``image_ref``), is
    returned unchanged."""
    if failure.code not in IMAGE_CODES or failure.stage == "encoder":
        return failure
    key = failure.image_key
    if key is None or key not in images:
        return failure
    if failure.code == Code.ENCODE_ABANDONED:
        return Failure("encoder", "", 503, f"the {failure.stage} stage reports: {failure.message}", failure.code,
                       retry_after=failure.retry_after or "1", room=failure.room, image_key=key)
    if failure.code == Code.IMAGE_NOT_CACHED:
        whose = f"sent to {images[key]}" if images[key] else "under way for another request"
        return Failure("encoder", "", 503, f"the encode of image {key} that this request waited for ({whose}) "
                       f"ended without an entry before the {failure.stage} looked. Nothing is wrong with the image; "
                       f"retry after {RETRY_AFTER_S} s.", Code.ENCODE_ABANDONED, retry_after=str(RETRY_AFTER_S),
                       room=failure.room, image_key=key)
    return Failure("encoder", images[key], max(failure.status, 502),
                   f"the {failure.stage} stage reports: {failure.message}", failure.code, room=failure.room,
                   image_key=key)


def _event_status(code: str | None) -> int:
    """The HTTP status an in-band error event's code stands for (a stream's status is already 200):
    the code's own when it is a 5xx (``contract.errors``), else 502."""
    rule = rule_of(code)
    return rule.status if rule is not None and rule.status >= 500 else 502


def _text(error: dict, name: str) -> str | None:
    value = error.get(name)
    return value if isinstance(value, str) and value else None


def _room(error: dict) -> int | None:
    room = error.get("room")
    return room if isinstance(room, int) and not isinstance(room, bool) else None


def _error_of(raw: bytes) -> dict:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}
