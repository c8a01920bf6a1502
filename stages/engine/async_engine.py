"""Runs an Engine on its own thread and exposes it to asyncio servers.

Contract: the engine thread is the only thread that touches the Engine. The event loop sends it
commands (add, abort) through a thread-safe queue and receives ``RequestOutput``s through one
asyncio queue per request (``loop.call_soon_threadsafe``). ``generate`` validates a request on the
caller's side first, so a bad request raises ValueError before it is queued. If the caller stops
iterating (client disconnect, cancellation), the request is aborted and its blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from stages.engine.engine import Engine, RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks on its command queue before looking again


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    blocks_used: int
    blocks_total: int


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        self._on_step = on_step  # called on the engine thread with the batch size after each step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        allocator = self.engine.allocator
        return EngineStats(self.engine.scheduler.num_waiting, self.engine.scheduler.num_running,
                           allocator.num_used, allocator.num_blocks)

    def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                 hand_off: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes. Raises ValueError for a request that can never run.
        ``hand_off``: prefill only; the final output carries the blocks (see ``Engine.add_request``)."""
        self.engine.check_request(prompt, params)
        return self._stream(request_id, lambda e: e.add_request(request_id, prompt, params, hand_off) and None)

    def generate_prefilled(self, request_id: str, prompt: Prompt, params: SamplingParams, blocks: list[int],
                           first_token: int, rope_delta: int) -> AsyncIterator[RequestOutput]:
        """Decode a request whose prompt KV is already in ``blocks``; the first output is ``first_token``'s.
        The engine owns ``blocks`` from the moment the command runs."""
        return self._stream(
            request_id, lambda e: e.add_prefilled(request_id, prompt, params, blocks, first_token, rope_delta)
        )

    async def _stream(self, request_id: str, start: Callable[[Engine], RequestOutput | None]) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id}")
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("start", request_id, start))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise its error)."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future))
        return await future

    # --- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_work())
                if not self.engine.has_work():
                    continue
                outputs = self.engine.step()
                if self._on_step is not None:
                    self._on_step(len(outputs))
                self._publish(outputs)
        except BaseException as exc:  # never leave a waiting request without an answer
            log.exception("engine thread died")
            error = f"engine thread died: {type(exc).__name__}: {exc}"
            self._publish([RequestOutput(rid, "", [], FinishReason.ABORT, 0, 0, error) for rid in list(self._streams)])
            raise

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind, *args = command
        if kind == "start":
            request_id, start = args
            try:
                first = start(self.engine)
            except Exception as exc:  # checked before queueing; this is a last line of defence
                log.exception("request %s refused", request_id)
                self._publish([RequestOutput(request_id, "", [], FinishReason.ABORT, 0, 0, str(exc))])
            else:
                if first is not None:
                    self._publish([first])
        elif kind == "call":
            fn, future = args
            loop = future.get_loop()
            try:
                result = fn(self.engine)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
        elif kind == "abort":
            output = self.engine.abort(args[0])
            if output is not None:
                self._publish([output])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                loop, outputs_queue = stream
                loop.call_soon_threadsafe(outputs_queue.put_nowait, output)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (cancelled); nothing to deliver
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
