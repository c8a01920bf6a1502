"""The prefill side of a room: pair, prefill, write the KV into the decode's blocks, report.

``PrefillCoordinator`` runs in the prefill server's event loop beside its ``AsyncEngine``. For
each room it pairs the server's own HTTP request (``prefill()``) with the decode's ``KVRequest``
(arriving on the bootstrap endpoint), in either order, within ``pair_timeout_s``. A paired room
is prefilled inside the engine's continuous batch as a hand-off request; its KV blocks are then
written into the decode's blocks by the transfer backend (on a worker thread), freed, and the
decode is sent ``KVReady`` (first token, rope delta). Every room ends with exactly one answer to
the decode (``KVReady`` or ``KVFailed``) and one result or error for the HTTP request.

Inputs (EPD mode): ``prefill`` may take an ``inputs`` coroutine (the room's image embeddings, read
from the cache: ``stages.disagg.embeddings``). It starts at once, beside the pairing; the paired
room awaits it before its request enters the engine, so a room whose inputs are not ready never
holds up the engine's other requests. If it fails, the room fails with its error on both halves:
at once if the room is paired (``KVFailed`` with that reason), and if not yet, the room is closed
with that reason, so the decode's ``KVRequest`` is refused with it when it comes.

An ``Abort`` from the decode stops a room that has not been prefilled yet; a write already in
flight is finished first, so ``KVFailed`` is only sent once nothing more can land in the
decode's blocks (the decode may then reuse them).

A failure is reported as what it is, to the HTTP half and (as the ``KVFailed`` reason) to the
decode: a ``TransferError`` from the write is "KV transfer failed" (502); any other unexpected
exception is a 500 naming its class and message (``stages.disagg.errors``). The prefill's
deadlines are its own: ``pair_timeout_s`` for the other half, ``prefill_timeout_s`` once paired.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from stages.config import DisaggConfig
from stages.disagg.errors import DisaggError, bad_gateway, conflict, internal, timed_out, transfer_failed
from stages.engine.async_engine import AsyncEngine
from stages.engine.block_allocator import blocks_for_tokens
from stages.engine.engine import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.faults import EXIT_CODE, Faults
from stages.supervisor import Supervisor
from stages.timeline import RoomTimeline
from transfer.base import TransferBackend, TransferError, block_ops
from transfer.bootstrap_server import BootstrapServer
from transfer.messages import Abort, Fingerprint, KVRequest
from transfer.rooms import DuplicateRoom, Entry, RoomClosed, RoomTable

log = logging.getLogger(__name__)
EXPIRE_EVERY_S = 0.5
IN_FLIGHT_SLACK_S = 5.0  # after a write timed out with bytes possibly in flight, wait this much longer


@dataclass(frozen=True)
class PrefillResult:
    room: int
    first_token: int
    text: str
    rope_delta: int
    prompt_tokens: int
    kv_bytes: int
    transfer_s: float


@dataclass
class _Local:
    prompt: Prompt
    params: SamplingParams
    inputs: asyncio.Task | None = None  # EPD: fills prompt.embeddings; awaited before the forward pass
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def stop_inputs(self) -> None:
        if self.inputs is not None and not self.inputs.done():
            self.inputs.cancel()


class PrefillCoordinator:
    def __init__(self, engine: AsyncEngine, backend: TransferBackend, fingerprint: Fingerprint,
                 config: DisaggConfig, *, supervisor: Supervisor, faults: Faults, timeline: RoomTimeline) -> None:
        """``timeline``: where each room's events are marked (``stages.timeline``)."""
        self.engine = engine
        self.backend = backend
        self.config = config
        self.supervisor = supervisor
        self.faults = faults
        self.timeline = timeline
        self.server = BootstrapServer(fingerprint, host=config.bootstrap_host, port=config.bootstrap_port)
        self.table: RoomTable[_Local, KVRequest] = RoomTable()
        self._running: dict[int, asyncio.Task] = {}
        self._aborted: dict[int, str] = {}

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
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        await self.server.close()

    def check(self, room: int) -> None:
        """Raise the DisaggError (409) that ``prefill(room, ...)`` would raise at once now; changes nothing."""
        try:
            self.table.check_local(room)
        except (DuplicateRoom, RoomClosed) as exc:
            raise conflict(f"bootstrap room {room}: {exc}") from exc

    async def prefill(self, room: int, prompt: Prompt, params: SamplingParams,
                      inputs: Coroutine[Any, Any, None] | None = None) -> PrefillResult:
        """The HTTP half of ``room``: returns once the KV is in the decode's blocks, or raises DisaggError.
        ``inputs`` (EPD): completes the prompt (its embeddings); run at once, awaited before the forward."""
        self.timeline.mark(room, "queued")
        local = _Local(prompt, params, asyncio.ensure_future(inputs) if inputs is not None else None)
        # the HTTP side may stop waiting (timeout, client gone); its result is then read by nobody
        local.result.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            entry = self.table.add_local(room, local, time.monotonic())
        except (DuplicateRoom, RoomClosed) as exc:
            local.stop_inputs()
            raise conflict(f"bootstrap room {room}: {exc}") from exc
        if entry is not None:
            self._start(entry)
        elif local.inputs is not None:
            local.inputs.add_done_callback(lambda done: self._inputs_done_unpaired(room, local, done))
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
            if self.faults.take("prefill.receive_loop_crash"):
                raise RuntimeError("fault point prefill.receive_loop_crash")
            if isinstance(message, Abort):
                await self._abort(message.room, f"decode aborted: {message.reason}")
                continue
            try:
                entry = self.table.add_remote(message.room, message, time.monotonic())
            except (DuplicateRoom, RoomClosed) as exc:
                await self.server.send_failed(message.room, str(exc))
                continue
            if entry is not None:
                self._start(entry)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            for entry in self.table.expire(time.monotonic(), self.config.pair_timeout_s):
                if entry.local is not None:
                    entry.local.stop_inputs()
                reason = entry.state.reason
                if entry.remote is not None:
                    await self.server.send_failed(entry.room, reason)
                if entry.local is not None and not entry.local.result.done():
                    entry.local.result.set_exception(timed_out(f"bootstrap room {entry.room}: {reason}"))

    def _inputs_done_unpaired(self, room: int, local: _Local, done: asyncio.Task) -> None:
        """A room's inputs ended before it was paired: if they failed, close the room with their error
        now (the decode's KV request is refused with it when it comes; the HTTP half gets it)."""
        if done.cancelled() or done.exception() is None or room in self._running:
            return
        entry = self.table.get(room)
        if entry is None or entry.local is not local:
            return
        error = _room_error(room, done.exception())  # type: ignore[arg-type]
        log.warning("room %d failed before pairing: %s", room, error)
        self.table.remove(room, str(error))
        if not local.result.done():
            local.result.set_exception(error)

    async def _abort(self, room: int, reason: str) -> None:
        """Stop a room wherever it is. Paired rooms stop at their next safe point (see ``_run``)."""
        entry = self.table.get(room)
        if entry is not None and entry.local is not None:
            entry.local.stop_inputs()
        if room in self._running:
            self._aborted.setdefault(room, reason)
            self.engine.abort(_request_id(room))
            return
        if entry is None:
            return
        self.table.remove(room, reason)
        if entry.remote is not None:
            await self.server.send_failed(room, reason)
        if entry.local is not None and not entry.local.result.done():
            entry.local.result.set_exception(bad_gateway(f"bootstrap room {room}: {reason}"))

    # --- one paired room -------------------------------------------------------------------------
    def _start(self, entry: Entry) -> None:
        self._running[entry.room] = asyncio.create_task(self._run(entry))

    async def _run(self, entry: Entry) -> None:
        """Prefill a paired room, write its KV into the decode's blocks and answer both halves. Any
        failure ends in ``_fail``; this prefill's blocks are freed however the room ends."""
        room, local, remote = entry.room, entry.local, entry.remote
        blocks: list[int] = []
        mark = self.timeline.mark
        try:
            self._check_pair(room, local, remote)
            mark(room, "paired")
            if local.inputs is not None:
                await self._inputs(room, local.inputs)
                mark(room, "embeddings_ready")
            if self.faults.take("prefill.exit_before_forward"):
                os._exit(EXIT_CODE)
            last = await self._forward(room, local)
            blocks = last.blocks
            mark(room, "prefilled", prompt_tokens=last.prompt_tokens)
            if self.faults.take("prefill.exit_after_forward"):
                os._exit(EXIT_CODE)
            if self.faults.take("prefill.crash"):
                raise RuntimeError(f"fault point prefill.crash on room {room}")
            started = time.perf_counter()
            moved = await asyncio.to_thread(self._write, remote, blocks)
            elapsed = time.perf_counter() - started
            mark(room, "kv_written", bytes=moved, seconds=elapsed)
            if delay := self.faults.take("prefill.delay_ready"):
                await asyncio.sleep(delay.delay_s)
            if room in self._aborted:
                raise bad_gateway(self._aborted[room])
            mark(room, "ready_sent")
            await self.server.send_ready(room, first_token=last.token_ids[0], rope_delta=last.rope_delta,
                                         prompt_tokens=last.prompt_tokens)
            if not local.result.done():
                local.result.set_result(PrefillResult(room, last.token_ids[0], last.text, last.rope_delta,
                                                      last.prompt_tokens, moved, elapsed))
        except Exception as exc:
            await self._fail(room, local, exc)
        finally:
            local.stop_inputs()
            if blocks:
                await self._free(room, blocks)
            self._running.pop(room, None)
            self._aborted.pop(room, None)
            if self.table.get(room) is not None:
                self.table.remove(room)

    async def _inputs(self, room: int, inputs: asyncio.Task) -> None:
        """Wait for the room's inputs; raise their error, or the abort that stopped them."""
        await asyncio.wait({inputs})
        if room in self._aborted:
            raise bad_gateway(self._aborted[room])
        if inputs.cancelled():
            raise internal(f"bootstrap room {room}: its image inputs were cancelled")
        inputs.result()

    async def _forward(self, room: int, local: _Local) -> RequestOutput:
        """Run the room's prompt through the engine as a hand-off request; the last output holds its blocks."""
        last = None
        async for last in self.engine.generate(_request_id(room), local.prompt, local.params, hand_off=True):
            pass
        if last is not None and last.blocks is not None:
            return last
        if room in self._aborted:
            raise bad_gateway(self._aborted[room])
        raise internal(f"bootstrap room {room}: the prefill's engine failed on this request: "
                       f"{last.error if last is not None and last.error else 'it ended without output'}")

    async def _fail(self, room: int, local: _Local, exc: Exception) -> None:
        """Answer both halves of a failed room with what failed: the HTTP half at once, the decode
        (``KVFailed``, same reason) once nothing more can land in its blocks."""
        error = _room_error(room, exc)
        self.timeline.mark(room, "failed", reason=str(error))
        if not isinstance(exc, DisaggError | TransferError):  # unexpected: keep its traceback
            log.error("room %d failed", room, exc_info=exc)
        else:
            log.warning("room %d failed: %s", room, error)
        if not local.result.done():
            local.result.set_exception(error)
        if isinstance(exc, TransferError) and exc.in_flight:
            # the library may still be writing into the decode's blocks: answer only once it cannot
            await asyncio.sleep(self.backend.config.timeout_s + IN_FLIGHT_SLACK_S)
        await self.server.send_failed(room, str(error))

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
        if len(remote.block_ids) < blocks_for_tokens(prompt_tokens, self.engine.engine.layout.block_size):
            raise bad_gateway(f"bootstrap room {room}: the decode reserved too few blocks for {prompt_tokens} tokens")

    def _write(self, remote: KVRequest, blocks: list[int]) -> int:
        """Worker thread: move the prompt's blocks into the decode's. Returns bytes moved; raises
        TransferError when the write fails."""
        if self.faults.take("prefill.fail_kv_write"):
            raise TransferError("fault point prefill.fail_kv_write: the write was dropped, nothing was written")
        peer = self.backend.connect(remote.descriptor)
        ops = block_ops(blocks, remote.block_ids[: len(blocks)], self.engine.engine.layout.block_bytes)
        self.engine.kv_ready()  # on a GPU the forward pass that wrote them may still be running
        return self.backend.write(peer, ops)


def _request_id(room: int) -> str:
    return f"room-{room}"


def _room_error(room: int, exc: Exception) -> DisaggError:
    """What a failure in the prefill path is: only a transfer error is "KV transfer failed"; anything
    unexpected is a 500 naming its class and message."""
    if isinstance(exc, DisaggError):
        return exc
    if isinstance(exc, TransferError):
        return transfer_failed(room, str(exc))
    return internal(f"bootstrap room {room}: the prefill failed: {type(exc).__name__}: {exc}")
