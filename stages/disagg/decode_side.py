"""The decode side of a room: reserve blocks, ask the prefill for the KV, then decode.

``DecodeCoordinator.generate`` is what the decode server runs for a request carrying a bootstrap
room: it reserves the prompt's KV blocks (the rest are taken as it decodes: ``Engine.reserve_blocks``),
sends the prefill's bootstrap endpoint a ``KVRequest`` (block ids + this process's transfer descriptor), waits for ``KVReady`` within
``kv_timeout_s`` in all and ``peer_idle_timeout_s`` of the prefill's silence (its heartbeats name the
room while it holds it: a vanished prefill fails the room in seconds, a slow one is not cut), and
hands the request to the engine, which decodes from the first token on: from each of the ``n``
sequences' first tokens, with their logprobs and the prompt's when asked (``stages.disagg.ready``),
and the request's guide advanced past the first tokens (the prefill constrained them with the same
grammar, compiled from the same body).

Prefix caching (the decode's own, ``Engine.reserve_cached``): the reservation starts with the longest
chain of the prompt's full blocks this decode has cached (from earlier rooms: the engine registers a
prompt's blocks once its KV has arrived); the ``KVRequest`` says how many (``cached_blocks``) and
lists only the blocks after them, so the prefill writes only the rest. Freeing drops this room's
references: cached blocks stay cached.

If anything fails before the hand-over (rejected handshake, prefill failure or death, timeout,
client disconnect), the request fails (a prefill's ``Rejected`` / ``KVFailed``: 502 ``peer_failed``
carrying the prefill's ``code`` as ``peer_code`` and its ``image_key``), the room is aborted at the
prefill and the blocks are freed once the prefill
confirms that nothing more will be written into them: as soon as that confirmation comes, and
without it only after ``ABORT_SETTLE_S + abort_grace_s`` (a prefill that was stopped and resumes
answers the queued ``Abort`` then), so a late write can never land in another request's KV.

The room's handover state is the bootstrap client's ``transfer.rooms.Room`` (``Bootstrapping`` when
the ``KVRequest`` is sent, ``WaitingForInput`` once the prefill accepted it, ``Success`` on ``KVReady``,
``Failed``); the timeline follows it (``kv_requested``, ``kv_ready``, ``failed``; ``GET /rooms/{room}``'s
``status``). ``_rooms`` is not a room state: it holds the requests running here, decoding included.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator
from contextlib import aclosing

from stages.config import DisaggConfig
from stages.disagg.errors import DisaggError, bad_gateway, conflict, not_allowed, timed_out, unavailable
from stages.disagg.hooks import DecodeHooks
from stages.disagg.ready import read
from stages.disagg.runtime import StageRuntime
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.prefilled import Prefilled
from stages.engine.sampling_params import SamplingParams
from stages.supervisor import Supervisor
from stages.timeline import RoomTimeline
from process.addresses import host_port
from transfer.bootstrap_client import BootstrapClient, PrefillFailed
from transfer.bootstrap_common import HandshakeError, HandshakeTimeout
from transfer.messages import KVRequest
from transfer.peer_policy import AllowList
from transfer.rooms import RoomStatus

log = logging.getLogger(__name__)
ABORT_SETTLE_S = 5.0  # an aborted room's blocks wait this long for the prefill's last word, plus --abort-grace-s
EVENTS = {RoomStatus.WaitingForInput: "kv_requested", RoomStatus.Success: "kv_ready", RoomStatus.Failed: "failed"}


class DecodeCoordinator:
    def __init__(self, runtime: StageRuntime, config: DisaggConfig, *, supervisor: Supervisor, hooks: DecodeHooks,
                 timeline: RoomTimeline, allow: AllowList) -> None:
        """``runtime``: the process's engine, transfer backend and fingerprint; ``allow``: the prefills it
        may dial (the server's, which the router may add to at runtime); ``hooks``: called at their points
        in each room's life (``stages.disagg.hooks``); ``timeline``: where each room's events are marked
        (``stages.timeline``)."""
        self.engine = runtime.engine
        self.fingerprint = runtime.fingerprint
        self.config = config
        self.supervisor = supervisor
        self.hooks = hooks
        self.timeline = timeline
        self.allow = allow
        self.descriptor = runtime.backend.descriptor()
        self.client = BootstrapClient(allow=allow, max_links=config.max_peer_links,
                                      link_idle_s=config.peer_link_idle_s, on_change=timeline.follow(EVENTS))
        self.decode_id = f"decode-{os.getpid()}"
        self._cleanups: set[asyncio.Future] = set()
        self._rooms: set[int] = set()  # rooms whose request is running here (``generate``)

    async def start(self) -> None:
        """Nothing long-lived to start or supervise: links to prefills are made on demand (the
        bootstrap client owns their tasks), and cleanups are per room (``_track``)."""

    async def close(self) -> None:
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self.client.close()

    def check(self, room: int, host: str, port: int) -> None:
        """Raise the DisaggError that ``generate`` would raise before reserving anything, now: 403 if
        ``host:port`` is not an allowed prefill, 409 if ``room`` is in flight on this decode. Changes nothing."""
        if not self.allow.allows(host, port):
            raise not_allowed(f"prefill {host_port(host, port)} is not allowed by --allowed-bootstrap "
                              f"(allowed: {self.allow})")
        if room in self._rooms:
            raise conflict(f"bootstrap room {room}: room {room} is already in flight on this decode")

    async def generate(self, room: int, host: str, port: int, prompt: Prompt, params: SamplingParams,
                       traceparent: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of ``room`` from its first token on. Raises DisaggError if the KV never arrives, and
        (``check``) 403 or 409 before reserving anything. The room is this decode's from the first
        step to the last output. ``traceparent`` travels in the ``KVRequest`` (the prefill may record
        its spans under it: ``stages.tracing``)."""
        self.check(room, host, port)
        self._rooms.add(room)
        try:
            async with aclosing(self._generate(room, host, port, prompt, params, traceparent)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._rooms.discard(room)

    async def _generate(self, room: int, host: str, port: int, prompt: Prompt, params: SamplingParams,
                        traceparent: str | None) -> AsyncGenerator[RequestOutput, None]:
        mark = self.timeline.mark
        mark(room, "queued")
        blocks, cached = await self._reserve(prompt, params)
        mark(room, "blocks_reserved", blocks=len(blocks), cached_blocks=cached)
        self.hooks.before_kv_request(room)
        try:
            request = KVRequest(room=room, fingerprint=self.fingerprint, block_ids=blocks[cached:],
                                prompt_tokens=len(prompt.token_ids), descriptor=self.descriptor,
                                decode_id=self.decode_id, cached_blocks=cached, traceparent=traceparent)
            await self.client.request_kv(host, port, request, accept_timeout_s=self.config.accept_timeout_s)
            ready = await self.client.wait_ready(room, timeout_s=self.config.kv_timeout_s,
                                                 idle_timeout_s=self.config.peer_idle_timeout_s)
        except BaseException as exc:  # the cleanup's abort fails the room's state with the reason
            self._clean_up_later(room, blocks, _reason(exc))
            if isinstance(exc, HandshakeTimeout):
                raise timed_out(f"bootstrap room {room}: {exc}") from exc
            if isinstance(exc, PrefillFailed):  # the prefill's own code and image travel on
                raise bad_gateway(f"bootstrap room {room}: {exc}", peer_code=exc.code,
                                  image_key=exc.image_key) from exc
            if isinstance(exc, HandshakeError):
                raise bad_gateway(f"bootstrap room {room}: {exc}") from exc
            raise
        try:
            first = read(room, ready, len(prompt.token_ids), params)
        except DisaggError:  # the prefill answered: nothing more lands in the blocks
            self._free_soon(blocks)
            raise
        finals: dict[int, RequestOutput] = {}  # each sequence's last output
        prefilled = Prefilled(f"room-{room}", prompt, params, blocks, first, ready.rope_delta, ready.cached_tokens)
        async for output in self.engine.generate_prefilled(prefilled):
            if not finals:
                mark(room, "first_token")
            finals[output.index] = output
            yield output
        if finals:  # sequence 0's finish reason; for n > 1 every sequence's too
            reasons = [o.finish_reason.value if o.finish_reason is not None else None for _, o in sorted(finals.items())]
            fields: dict[str, object] = {"finish_reasons": reasons} if len(reasons) > 1 else {}
            mark(room, "finished", None, completion_tokens=sum(o.completion_tokens for o in finals.values()),
                 finish_reason=reasons[0], **fields)

    async def _reserve(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], int]:
        """The request's blocks and how many leading ones hold the prompt's KV already (this decode's
        prefix cache: the prefill need not send them)."""
        call = asyncio.ensure_future(self.engine.call(lambda engine: engine.reserve_cached(prompt, params),
                                                      undo=lambda engine, held: engine.free_blocks(held[0])))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:  # the blocks may still arrive: free them when they do
            call.add_done_callback(self._free_when_reserved)
            raise
        except MemoryError as exc:
            raise unavailable(f"the decode's KV pool has no room for this request now ({exc}); retry later") from exc

    def _clean_up_later(self, room: int, blocks: list[int], reason: str) -> None:
        self._track(asyncio.ensure_future(self._clean_up(room, blocks, reason)))

    async def _clean_up(self, room: int, blocks: list[int], reason: str) -> None:
        """Abort ``room`` at the prefill and free its blocks once the prefill's last word came, or
        after ``ABORT_SETTLE_S + abort_grace_s`` without it."""
        wait_s = ABORT_SETTLE_S + self.config.abort_grace_s
        if not await self.client.abort(room, reason, settle_timeout_s=wait_s):
            log.warning("room %d: prefill never confirmed the abort within %g s; freeing its %d blocks now",
                        room, wait_s, len(blocks))
        await self.engine.call(lambda engine: engine.free_blocks(blocks))

    def _free_when_reserved(self, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            self._free_soon(done.result()[0])

    def _free_soon(self, blocks: list[int]) -> None:
        self._track(asyncio.ensure_future(self.engine.call(lambda engine: engine.free_blocks(blocks))))

    def _track(self, task: asyncio.Future) -> None:
        """Keep a per-room cleanup until it ends (``close`` waits for them); log one that fails, with
        its traceback (its blocks stay reserved: the engine is gone or broken, and /health says so)."""
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a room cleanup on the decode failed", exc_info=(type(exc), exc, exc.__traceback__))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "the decode's client went away"
    if isinstance(exc, DisaggError | HandshakeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
