"""The prefill side of a room: pair, prefill, write the KV into the decode's blocks, report.

``PrefillCoordinator`` runs in the prefill server's event loop beside its ``AsyncEngine``. For
each room it pairs the server's own HTTP request (``prefill()``) with the decode's ``KVRequest``
(arriving on the bootstrap endpoint), in either order, within ``pair_timeout_s``. A room is prefilled
inside the engine's continuous batch as a hand-off request from the moment its HTTP half arrives,
without waiting for the decode's half: the handshake's round trips (the decode reserving blocks and
sending its ``KVRequest``) overlap the forward pass instead of preceding it. Once the room is paired
and prefilled, its KV blocks are written into the decode's blocks by the transfer backend (on a
worker thread), freed, and the decode is sent ``KVReady`` (first tokens, their logprobs and the prompt's: ``stages.disagg.ready``;
rope delta). A request of ``n`` sequences is prefilled once and ends in n outputs, one first token each
(the first holds the blocks); its KV is written once. Every room ends with exactly one answer to
the decode (``KVReady`` or ``KVFailed``) and one result or error for the HTTP request.

Inputs (EPD mode): ``prefill`` may take an ``inputs`` coroutine (the room's image embeddings, read
from the cache: ``stages.disagg.embeddings``). It starts at once, beside the pairing. Without a
``feed`` the room awaits it before its request enters the engine. With one (``--prefill-overlap``:
the prompt's embeddings are ``pending`` stand-ins and ``inputs`` hands each to the feed as it lands) the
room's request enters the engine at once, ``awaiting`` them: the engine computes the text before
the first image and each image's span once its embedding is given (``Engine.provide``), so the
prefill overlaps the encode (the timeline's ``embeddings_ready`` carries ``overlap_s``, how long the
room's request had been in the engine by then, and ``computed_tokens``, the most prompt tokens it had
computed when an embedding came). Either way a room whose inputs are not ready never holds up the
engine's other requests. If they fail (or the forward pass fails), the room fails with their error
on both halves: at once if the room is paired (its engine request aborted, its blocks freed;
``KVFailed`` with that reason), and if not yet, the room is closed with that reason, so the decode's
``KVRequest`` is refused with it when it comes.

A room's state (``transfer.rooms.Room``, in the room table's entry) is the one record of where it
stands: ``Bootstrapping`` (one half here; its forward pass may be running or done, holding its blocks),
``WaitingForInput`` (paired), ``Transferring`` (prefilled,
its KV being written), ``Success`` (``KVReady`` sent) or ``Failed``. Every change goes through it, and
the room timeline follows it (``paired``, ``ready_sent``, ``failed``; ``GET /rooms/{room}``'s
``status``). An abort is a failure: an unpaired room is failed and closed at once (its forward pass
stopped, or the blocks it finished with freed); a paired one is failed, and its runner stops at its
next safe point (before the forward pass ends, before the write,
before ``KVReady``); a write already in flight is finished first, so ``KVFailed`` is only sent once
nothing more can land in the decode's blocks (the decode may then reuse them).

A failure is reported as what it is, to the HTTP half and (as the ``KVFailed`` reason, with the
same error's ``code`` and ``image_key`` as that message's typed fields) to the decode: a
``TransferError`` from the write is "KV transfer failed" (502); any other unexpected exception is a
500 naming its class and message (``stages.disagg.errors``). A room closed with an error before the
decode's half came (its inputs failed, it expired, it was aborted) keeps that error
(``_closed_errors``, the last ``CLOSED_ERRORS`` rooms), so the decode's late ``KVRequest`` is
refused with its code and image too. The prefill's
deadlines are its own: ``pair_timeout_s`` for the other half, ``prefill_timeout_s`` once paired.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from stages.config import DisaggConfig
from stages.disagg.errors import DisaggError, bad_gateway, conflict, internal, timed_out, transfer_failed
from stages.disagg.hooks import PrefillHooks
from stages.disagg.input_feed import InputFeed, feed_engine
from stages.disagg.ready import ready_message
from stages.disagg.runtime import StageRuntime
from stages.engine.block_allocator import blocks_for_tokens
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.supervisor import Supervisor
from stages.timeline import RoomTimeline
from transfer.base import TransferError
from transfer.bootstrap_server import BootstrapServer
from transfer.messages import Abort, KVRequest
from transfer.ops import block_ops
from transfer.rooms import DuplicateRoom, Entry, Room, RoomClosed, RoomStatus, RoomTable

log = logging.getLogger(__name__)
EXPIRE_EVERY_S = 0.5
EVENTS = {RoomStatus.WaitingForInput: "paired", RoomStatus.Success: "ready_sent", RoomStatus.Failed: "failed"}
IN_FLIGHT_SLACK_S = 5.0  # after a write timed out with bytes possibly in flight, wait this much longer
CLOSED_ERRORS = 4096  # rooms closed with an error before their decode came: their errors kept for it


@dataclass(frozen=True)
class PrefillResult:
    """A room done: its hand-off's outputs (one per sequence, in index order, each one first token,
    its logprobs when asked, the first the prompt's logprobs when asked; no blocks: they were freed)
    and what its KV write took."""

    room: int
    outputs: list[RequestOutput]
    kv_bytes: int
    transfer_s: float


@dataclass
class _Local:
    prompt: Prompt
    params: SamplingParams
    inputs: asyncio.Task | None = None  # EPD: fills prompt.embeddings; awaited before the forward pass
    feed: InputFeed | None = None  # EPD with overlap: ``inputs`` feeds this instead; not awaited before
    late_error: DisaggError | None = None  # EPD with overlap: a covered image's late read failed
    forward: asyncio.Task | None = None  # the forward pass, from arrival (``_compute``): its outputs hold the blocks
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def stop_inputs(self) -> None:
        if self.inputs is not None and not self.inputs.done():
            self.inputs.cancel()


class PrefillCoordinator:
    def __init__(self, runtime: StageRuntime, config: DisaggConfig, *, supervisor: Supervisor, hooks: PrefillHooks,
                 timeline: RoomTimeline) -> None:
        """``runtime``: the process's engine, transfer backend and fingerprint; ``hooks``: called at their
        points in each room's life (``stages.disagg.hooks``); ``timeline``: where each room's events are
        marked (``stages.timeline``)."""
        self.engine = runtime.engine
        self.layout = runtime.engine.layout  # the KV pool's shape: fixed at load
        self.backend = runtime.backend
        self.config = config
        self.supervisor = supervisor
        self.hooks = hooks
        self.timeline = timeline
        self.server = BootstrapServer(runtime.fingerprint, host=config.bootstrap_host, port=config.bootstrap_port,
                                      heartbeat_s=config.peer_heartbeat_s)
        self.table: RoomTable[_Local, KVRequest] = RoomTable(on_change=timeline.follow(EVENTS))
        self._runs: set[asyncio.Task] = set()  # forward passes, runners of paired rooms, frees (``close`` cancels them)
        # rooms closed with an error before the decode's half came -> that error (``_keep_error``)
        self._closed_errors: OrderedDict[int, DisaggError] = OrderedDict()
        # rooms whose decode sent a traceparent in its KVRequest -> it (``traceparent_of``; the last CLOSED_ERRORS)
        self._traceparents: OrderedDict[int, str] = OrderedDict()

    @property
    def bootstrap_port(self) -> int:
        return self.server.port

    async def start(self) -> None:
        """Bind the bootstrap endpoint; supervise its serve task, the transfer backend's worker
        threads (where it has observable ones), and the receive and expiry loops started here."""
        await self.server.start()
        assert self.server.serve_task is not None
        self.supervisor.watch("prefill bootstrap server", self.server.serve_task)
        self.supervisor.watch_thread(f"{self.backend.name} transfer workers", self.backend.threads_alive)
        self.supervisor.spawn("prefill bootstrap receive loop", self._receive())
        self.supervisor.spawn("prefill room expiry loop", self._expire())

    async def close(self) -> None:
        """After ``supervisor.stop()``: cancel rooms in flight, then close the endpoint."""
        for task in self._runs:
            task.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)
        await self.server.close()

    def traceparent_of(self, room: int) -> str | None:
        """The ``traceparent`` the decode's ``KVRequest`` for ``room`` carried (None: it came without one,
        or never came), forgotten once read: the parent of the room's spans when the HTTP half came
        untraced (``stages.tracing``)."""
        return self._traceparents.pop(room, None)

    def check(self, room: int) -> None:
        """Raise the DisaggError (409) that ``prefill(room, ...)`` would raise at once now; changes nothing."""
        try:
            self.table.check_local(room)
        except (DuplicateRoom, RoomClosed) as exc:
            raise conflict(f"bootstrap room {room}: {exc}") from exc

    async def prefill(self, room: int, prompt: Prompt, params: SamplingParams,
                      inputs: Coroutine[Any, Any, None] | None = None, feed: InputFeed | None = None) -> PrefillResult:
        """The HTTP half of ``room``: returns once the KV is in the decode's blocks, or raises DisaggError.
        ``inputs`` (EPD): completes the prompt (its embeddings); run at once, awaited before the forward,
        or with ``feed`` (which it fills) given to the engine request as they land (module docstring)."""
        self.timeline.mark(room, "queued")
        local = _Local(prompt, params, asyncio.ensure_future(inputs) if inputs is not None else None, feed)
        # the HTTP side may stop waiting (timeout, client gone); its result is then read by nobody
        local.result.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            entry = self.table.add_local(room, local, time.monotonic())
        except (DuplicateRoom, RoomClosed) as exc:
            local.stop_inputs()
            raise conflict(f"bootstrap room {room}: {exc}") from exc
        added = self.table.get(room)
        assert added is not None  # added just now, and nothing ran in between
        local.forward = self._track(self._compute(added.state, local))
        local.forward.add_done_callback(lambda done: self._computed_unpaired(room, local, done))
        if entry is not None:
            self._start(entry)
        deadline = self.config.pair_timeout_s + self.config.prefill_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(local.result), deadline)
        except asyncio.TimeoutError:
            await self._abort(room, f"prefill did not finish within {deadline:g} s")
            raise timed_out(f"bootstrap room {room}: prefill did not finish within {deadline:g} s") from None
        except asyncio.CancelledError:
            await self._abort(room, "the prefill's client went away")
            raise

    # --- bootstrap endpoint --------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            message = await self.server.recv()
            self.hooks.received()
            if isinstance(message, Abort):
                await self._abort(message.room, f"decode aborted: {message.reason}")
                continue
            if message.traceparent is not None:
                self._traceparents[message.room] = message.traceparent
                while len(self._traceparents) > CLOSED_ERRORS:
                    self._traceparents.popitem(last=False)
            try:
                entry = self.table.add_remote(message.room, message, time.monotonic())
            except (DuplicateRoom, RoomClosed) as exc:
                error = self._closed_errors.pop(message.room, None) if isinstance(exc, RoomClosed) else None
                await self._send_failed(message.room, str(exc), error)
                continue
            if entry is not None:
                self._start(entry)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            for entry in self.table.expire(time.monotonic(), self.config.pair_timeout_s):
                await self._answer_unpaired(entry, timed_out(f"bootstrap room {entry.room}: {entry.state.reason}"))

    def _computed_unpaired(self, room: int, local: _Local, done: asyncio.Task) -> None:
        """A room's forward pass (its inputs first) ended before the room was paired: if it failed, close
        the room with its error now (the decode's KV request is refused with it when it comes; the HTTP
        half gets it). One that succeeded holds its blocks for the runner, once paired."""
        entry = self.table.get(room)
        failure = None if done.cancelled() else done.exception()
        if failure is None or entry is None or entry.local is not local or entry.paired:
            return
        error = _room_error(room, failure)
        if isinstance(failure, DisaggError):
            log.warning("room %d failed before pairing: %s", room, error)
        else:  # unexpected: keep its traceback
            log.error("room %d failed before pairing", room, exc_info=failure)
        self.table.fail(room, str(error), time.monotonic())
        self._keep_error(room, error)
        _answer(local, error)  # the decode's half is not here: it is refused with the reason when it comes

    async def _abort(self, room: int, reason: str) -> None:
        """Stop a room wherever it is: fail its state. An unpaired room is closed and both halves
        answered now; a paired one stops at its runner's next safe point (see ``_run``)."""
        entry = self.table.get(room)
        if entry is None:
            return
        if entry.paired:
            if entry.local is not None:
                entry.local.stop_inputs()
            if entry.state.fail(reason, time.monotonic()):
                self.engine.abort(_request_id(room))
            return
        self.table.fail(room, reason, time.monotonic())
        await self._answer_unpaired(entry, bad_gateway(f"bootstrap room {room}: {reason}"))

    async def _answer_unpaired(self, entry: Entry[_Local, KVRequest], error: DisaggError) -> None:
        """Answer the halves that arrived of a room failed before pairing (already out of the table):
        the HTTP half ``error`` (its forward pass stopped, or what it holds freed), the decode
        ``KVFailed`` with the room's reason."""
        if entry.local is not None:
            self._release(entry.room, entry.local)
            _answer(entry.local, error)
        if entry.remote is not None:
            await self._send_failed(entry.room, entry.state.reason or str(error), error)
        else:
            self._keep_error(entry.room, error)

    def _keep_error(self, room: int, error: DisaggError) -> None:
        """Keep the error ``room`` was closed with before its decode's half came, for that half
        (``_receive``); the oldest go first beyond ``CLOSED_ERRORS``."""
        self._closed_errors[room] = error
        self._closed_errors.move_to_end(room)
        while len(self._closed_errors) > CLOSED_ERRORS:
            self._closed_errors.popitem(last=False)

    async def _send_failed(self, room: int, reason: str, error: DisaggError | None) -> None:
        """The decode's ``KVFailed`` for ``room``: ``reason``, and ``error``'s code and image key as
        its typed fields (the ones this prefill answers its own client with; none without ``error``)."""
        await self.server.send_failed(room, reason, code=error.code if error is not None else None,
                                      image_key=error.image_key if error is not None else None)

    def _release(self, room: int, local: _Local) -> None:
        """A room ended before it was paired: stop its inputs and its forward pass (which frees what it
        holds as it stops), or free the blocks it finished with."""
        local.stop_inputs()
        forward = local.forward
        if forward is None:
            return
        if not forward.done():
            forward.cancel()
        elif not forward.cancelled() and forward.exception() is None:
            blocks = forward.result()[0].blocks or []
            if blocks:
                self._track(self._free(room, blocks))

    def _track(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``work`` as a task that ``close`` cancels."""
        task = asyncio.create_task(work)
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)
        return task

    # --- one room's forward pass, from its HTTP half's arrival -----------------------------------
    async def _compute(self, state: Room, local: _Local) -> list[RequestOutput]:
        """The room's forward pass, started when its HTTP half arrives (paired or not): its inputs
        first where they are awaited (EPD without the overlap), then its engine request. Returns each
        sequence's output, the first holding the prompt's blocks, which whoever takes the result frees:
        the runner of the paired room (``_run``), or ``_release`` for a room that ended unpaired."""
        room, mark = state.room, self.timeline.mark
        if local.inputs is not None and local.feed is None:
            await self._inputs(state, local.inputs)
            mark(room, "embeddings_ready")
        self.hooks.before_forward(room)
        outputs = await self._forward(state, local)
        first = outputs[0]
        mark(room, "prefilled", prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens)
        return outputs

    # --- one paired room -------------------------------------------------------------------------
    def _start(self, entry: Entry[_Local, KVRequest]) -> None:
        self._track(self._run(entry))

    async def _run(self, entry: Entry[_Local, KVRequest]) -> None:
        """Take a paired room's forward pass (``_compute``), write its KV into the decode's blocks and
        answer both halves. Any failure (an abort: the state ``Failed``, seen at each safe point) ends
        in ``_fail``; this prefill's blocks are freed however the room ends."""
        room, local, remote, state = entry.room, entry.local, entry.remote, entry.state
        assert local is not None and remote is not None and local.forward is not None  # paired: both halves
        blocks: list[int] = []
        mark = self.timeline.mark
        try:
            outputs = await local.forward  # its failure, or the abort that stopped it, is raised here
            blocks = outputs[0].blocks or []  # _forward returns only a first output that holds them
            self._check_pair(room, local, remote)
            self.hooks.after_forward(room)
            _advance(state, RoomStatus.Transferring)  # nothing written yet: an aborted room stops here
            started = time.perf_counter()
            moved = await asyncio.to_thread(self._write, remote, blocks)
            elapsed = time.perf_counter() - started
            mark(room, "kv_written", bytes=moved, seconds=elapsed)
            await self.hooks.before_ready(room)
            _advance(state, RoomStatus.Success)  # before KVReady: the decode's kv_ready may come first
            await self.server.send_ready(ready_message(room, outputs))
            _answer(local, PrefillResult(room, [dataclasses.replace(o, blocks=None) for o in outputs],
                                         moved, elapsed))
        except Exception as exc:
            if blocks:  # before _fail, which may wait out a write still in flight: the source blocks are
                await self._free(room, blocks)  # only read, and the decode's stay held until KVFailed
                blocks = []
            await self._fail(state, local, exc)
        finally:
            local.stop_inputs()
            if not local.forward.done():  # this runner was cancelled (close): so is the forward pass
                local.forward.cancel()
            if blocks:
                await self._free(room, blocks)
            if self.table.get(room) is not None:
                self.table.remove(room)

    async def _inputs(self, state: Room, inputs: asyncio.Task) -> None:
        """Wait for the room's inputs; raise their error, or the abort that stopped them."""
        await asyncio.wait({inputs})
        _check_live(state)
        if inputs.cancelled():
            raise internal(f"bootstrap room {state.room}: its image inputs were cancelled")
        inputs.result()

    async def _forward(self, state: Room, local: _Local) -> list[RequestOutput]:
        """Run the room's prompt through the engine as a hand-off request: the finished output of each of
        its ``n`` sequences, in index order, the first holding the prompt's blocks. Frees the blocks
        itself if it raises (a sequence failed, or one is missing)."""
        finished: dict[int, RequestOutput] = {}
        ended = False  # the stream ended by itself (not by an exception: a cancel may come after the last output)
        request_id, feeding = _request_id(state.room), local.feed is not None
        stream = self.engine.generate(request_id, local.prompt, local.params, hand_off=True, awaiting=feeding)
        # the feed task first runs when this coroutine first waits, in the stream, after it queued the
        # request's start: the engine takes the start before any embedding the feed hands it
        feeder = asyncio.create_task(self._feed(state.room, local)) if feeding else None
        try:
            async for output in stream:
                if output.finished:
                    finished[output.index] = output
            ended = True
        finally:
            if feeder is not None:
                feeder.cancel()
            if local.feed is not None and ended:
                local.feed.finish()
            outputs = [finished[i] for i in sorted(finished)]
            held = [block for o in outputs for block in o.blocks or []]
            complete = (ended and sorted(finished) == list(range(local.params.n)) and outputs[0].blocks is not None
                        and all(o.error is None and o.token_ids for o in outputs))
            if held and not complete:
                await self._free(state.room, held)
        if complete:
            return outputs
        _check_live(state)
        if local.late_error is not None:
            raise local.late_error
        if local.inputs is not None and local.inputs.done() and not local.inputs.cancelled():
            local.inputs.result()  # the inputs failed (the feed aborted the request): their error
        error = next((o.error for o in outputs if o.error), None)
        raise internal(f"bootstrap room {state.room}: the prefill's engine failed on this request: "
                       f"{error or f'it ended with {len(outputs)} of its {local.params.n} sequences'}")

    async def _feed(self, room: int, local: _Local) -> None:
        """The room's embeddings into its engine request (``input_feed.feed_engine``): a late read's
        failure kept for ``_forward`` to raise, ``embeddings_ready`` marked once all are in."""
        assert local.feed is not None and local.inputs is not None
        fed = await feed_engine(local.feed, local.inputs, self.engine, _request_id(room))
        if fed.error is not None:
            local.late_error = fed.error
        elif fed.overlap_s is not None:
            self.timeline.mark(room, "embeddings_ready", overlap_s=fed.overlap_s, computed_tokens=fed.computed_tokens)

    async def _fail(self, state: Room, local: _Local, exc: Exception) -> None:
        """Fail the room (an aborted one keeps its first reason) and answer both halves with what
        failed: the HTTP half at once, the decode (``KVFailed``, same reason) once nothing more can
        land in its blocks."""
        room, error = state.room, _room_error(state.room, exc)
        state.fail(str(error), time.monotonic())
        if not isinstance(exc, DisaggError | TransferError):  # unexpected: keep its traceback
            log.error("room %d failed", room, exc_info=exc)
        else:
            log.warning("room %d failed: %s", room, error)
        _answer(local, error)
        if isinstance(exc, TransferError) and exc.in_flight:
            # the library may still be writing into the decode's blocks: answer only once it cannot
            await asyncio.sleep(self.backend.config.timeout_s + IN_FLIGHT_SLACK_S)
        await self._send_failed(room, str(error), error)

    async def _free(self, room: int, blocks: list[int]) -> None:
        try:
            await self.engine.call(lambda engine: engine.free_blocks(blocks))
        except Exception:  # the engine is gone or broken: /health says so; the room still ends
            log.exception("room %d: could not free %d prefill blocks", room, len(blocks))

    def _check_pair(self, room: int, local: _Local, remote: KVRequest) -> None:
        prompt_tokens = len(local.prompt.token_ids)
        if remote.prompt_tokens != prompt_tokens:
            raise bad_gateway(
                f"bootstrap room {room}: the decode built a {remote.prompt_tokens}-token prompt, the prefill "
                f"{prompt_tokens}; both must get the same request and run the same model and chat template"
            )
        # the bootstrap server checked cached_blocks and the blocks against D's prompt length, equal to ours
        if remote.cached_blocks + len(remote.block_ids) < blocks_for_tokens(prompt_tokens, self.layout.block_size):
            raise bad_gateway(f"bootstrap room {room}: the decode reserved too few blocks for {prompt_tokens} tokens")

    def _write(self, remote: KVRequest, blocks: list[int]) -> int:
        """Worker thread: move the prompt's blocks into the decode's. Returns bytes moved; raises
        TransferError when the write fails."""
        peer = self.backend.connect(remote.descriptor)
        mine = blocks[remote.cached_blocks:]  # the decode has the first ones in its own prefix cache
        ops = block_ops(mine, remote.block_ids[: len(mine)], self.layout.block_bytes)
        self.engine.kv_ready()  # on a GPU the forward pass that wrote them may still be running
        return self.backend.write(peer, ops)


def _request_id(room: int) -> str:
    return f"room-{room}"


def _check_live(state: Room) -> None:
    """Raise the abort that failed the room (502 with its reason), if it was failed."""
    if state.failed:
        raise bad_gateway(state.reason or f"bootstrap room {state.room} failed")


def _advance(state: Room, status: RoomStatus) -> None:
    """Move a paired room on to ``status``, unless it was failed (aborted): then raise that abort."""
    _check_live(state)
    state.advance(status, time.monotonic())


def _answer(local: _Local, outcome: PrefillResult | DisaggError) -> None:
    """Give the HTTP half its answer, unless it has one (or stopped waiting)."""
    if local.result.done():
        return
    if isinstance(outcome, DisaggError):
        local.result.set_exception(outcome)
    else:
        local.result.set_result(outcome)


def _room_error(room: int, exc: BaseException) -> DisaggError:
    """What a failure in the prefill path is: only a transfer error is "KV transfer failed"; anything
    unexpected is a 500 naming its class and message."""
    if isinstance(exc, DisaggError):
        return exc
    if isinstance(exc, TransferError):
        return transfer_failed(room, str(exc))
    return internal(f"bootstrap room {room}: the prefill failed: {type(exc).__name__}: {exc}")
