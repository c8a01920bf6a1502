"""Runs an Engine on its own thread and exposes it to asyncio servers.

Contract: the engine thread is the only thread that touches the Engine. The event loop sends it
commands (start a request, abort one, run a function between steps) through a thread-safe queue
and receives ``RequestOutput``s through one asyncio queue per request (``loop.call_soon_threadsafe``).
``generate`` validates a request on the caller's side first, so a bad request raises ValueError
before it is queued. If the caller stops iterating (client disconnect, cancellation), the request
is aborted and its blocks are freed. A request with ``params.n > 1`` is one stream of the outputs of
all its sequences (each output's ``index`` says whose), which ends once every sequence has finished;
an abort aborts them all.

Nobody waits forever:

- every ``call`` has a deadline (``timeout_s``); past it the caller gets ``EngineTimeout``;
- when the engine thread ends (it died, or ``shutdown``), every request stream gets a final
  output with ``error`` set, every queued ``call`` raises ``EngineUnavailable``, and so does every
  ``call``/``generate``/``generate_prefilled`` issued afterwards, at once. The end is marked under
  the same lock that guards putting a command, so no command can slip in after the final drain.

``before_step(busy)`` (optional) is called on the engine thread once per loop iteration, after the
queued commands are applied: with ``busy`` True right before a step, False about every
``IDLE_WAIT_S`` while idle. Servers wire their fault points to it (an exception it raises ends the
engine thread; a sleep in it stalls the engine).

Handing outputs over yields the CPU (``os.sched_yield``, which also releases the GIL): the event
loop thread, woken by the hand-over, then sends them at once instead of waiting for the engine
thread's next step to use up its time slice. Where a server has one core (a pinned CPU server) that
wait was 1-5 ms on every first token (measured: the decode's first token reached its event loop
2.7 ms after the engine thread had it, 0.09 ms with the yield); with a free core it costs a syscall.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stages.engine.engine import Engine

from stages.engine.outputs import EngineStats, RequestOutput
from stages.engine.dtype_choice import DTypeChoice
from stages.engine.kv_pool import KVLayout
from stages.engine.kv_sizing import KVSizing
from stages.engine.multimodal import Prompt
from stages.engine.prefilled import Prefilled
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks on its command queue before looking again
CALL_TIMEOUT_S = 30.0  # default deadline of ``AsyncEngine.call``


class EngineUnavailable(RuntimeError):
    """The engine thread is not running (it died or was shut down), so nothing sent to it will run.
    Servers answer 503."""


class EngineTimeout(EngineUnavailable, TimeoutError):
    """A ``call`` got no answer from the engine thread before its deadline: the thread is stuck or far
    behind. Servers answer 503."""


@dataclass(eq=False)
class _Call:
    """One ``call``: ``started`` and ``withdrawn`` change only under ``AsyncEngine._lock``."""

    fn: Callable[[Engine], Any]
    future: asyncio.Future
    undo: Callable[[Engine, Any], None] | None = None
    started: bool = field(default=False)
    withdrawn: bool = field(default=False)


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[int, float], None] | None = None,
                 before_step: Callable[[bool], None] | None = None) -> None:
        self._engine = engine  # touched on the engine thread only, but for what never changes after loading
        self._on_step = on_step  # called on the engine thread after each step: batch size, seconds it took
        self._before_step = before_step  # called on the engine thread each loop iteration: busy (a step follows)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}  # loop, queue, n
        self._lock = threading.Lock()  # guards _ended, putting commands, registering streams, call states
        self._ended: str | None = None  # why the engine thread is no longer running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread; whatever is still waiting on it fails with ``EngineUnavailable``."""
        self._stop.set()
        self._put_quietly(("wake",))
        if self._thread.ident is None:  # never started: nobody else will fail what was queued
            self._end("the engine was shut down")
        else:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._ended is None

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def layout(self) -> KVLayout:
        """The KV pool's shape (block size, bytes a block), fixed at load."""
        return self._engine.layout

    @property
    def dtype(self) -> DTypeChoice:
        """The weights' and the pool's dtype and why (``--dtype``, or what ``auto`` chose), fixed at load."""
        return self._engine.dtype

    @property
    def kv_sizing(self) -> KVSizing:
        """The pool's blocks and bytes and where that size came from, fixed at load."""
        return self._engine.kv_sizing

    def check_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """``Engine.check_request`` from any thread: it reads only what never changes after loading.
        ValueError (a message for the client) if the request can never run here."""
        self._engine.check_request(prompt, params)

    def prefix_hint(self, prompt: Prompt) -> int:
        """``Engine.prefix_hint``, read from this (the caller's) thread: a hint."""
        return self._engine.prefix_hint(prompt)

    def kv_ready(self) -> None:
        """Any thread: return once the KV written by every finished step is in memory, so that its
        blocks may be handed to a transfer engine (``Engine.kv_ready``)."""
        self._engine.kv_ready()

    def stats(self) -> EngineStats:
        """Any thread: the engine's counters now (each read once; they may be a step apart)."""
        return self._engine.stats()

    def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                 hand_off: bool = False, awaiting: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs until the request finishes (each of its ``params.n`` sequences). Raises ValueError
        for a request that can never run, EngineUnavailable if the engine thread is not running (then or
        when the request is queued). ``hand_off``: prefill only; each sequence's one output is final,
        sequence 0's carries the blocks; ``awaiting``: its pending images come through ``provide``
        (see ``Engine.add_request``)."""
        self._check_running()
        self._engine.check_request(prompt, params)

        def start(engine: Engine) -> None:
            engine.add_request(request_id, prompt, params, hand_off, awaiting)

        return self._stream(request_id, params.n, start)

    def generate_prefilled(self, prefilled: Prefilled) -> AsyncGenerator[RequestOutput, None]:
        """Decode a request whose prompt KV is already in its blocks; each sequence's first output is its
        first token (``Engine.add_prefilled``). The engine owns the blocks from the moment the command
        runs. Raises EngineUnavailable if the engine thread is not running (then the caller still owns
        the blocks)."""
        self._check_running()
        return self._stream(prefilled.request_id, prefilled.params.n, lambda e: e.add_prefilled(prefilled))

    async def _stream(self, request_id: str, n: int,
                      start: Callable[[Engine], object]) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of ``n`` sequences until each has finished; the request is aborted if the caller
        stops before."""
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            self._raise_if_ended()
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id}")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs, n)
            self._commands.put(("start", request_id, start))
        finished: set[int] = set()
        try:
            while len(finished) < n:
                output = await outputs.get()
                if output.finished:
                    finished.add(output.index)
                yield output
        finally:
            self._streams.pop(request_id, None)
            if len(finished) < n:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._put_quietly(("abort", request_id))

    async def call(self, fn: Callable[[Engine], T], timeout_s: float = CALL_TIMEOUT_S,
                   undo: Callable[[Engine, T], None] | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise its error).

        Raises EngineUnavailable at once if the engine thread is not running or ends before ``fn``
        runs, and EngineTimeout if no answer comes within ``timeout_s``. A call given up (deadline
        or cancellation) before ``fn`` starts never runs. One given up after ``fn`` started has its
        result handed to ``undo(engine, result)`` on the engine thread, when given, so that what
        ``fn`` took (reserved blocks, say) is given back."""
        command = _Call(fn, asyncio.get_running_loop().create_future(), undo)
        self._put(("call", command))
        answered = False
        try:
            await asyncio.wait({command.future}, timeout=timeout_s)
            answered = command.future.done()
        finally:
            if not answered:
                ran = self._give_up(command)
        if answered:
            return command.future.result()
        raise EngineTimeout(f"the engine thread did not answer within {timeout_s:g} s; the call "
                            + ("ran late and its result was dropped" if ran else "was withdrawn and did not run"))

    # --- the command queue (any thread) --------------------------------------------------------
    def _check_running(self) -> None:
        with self._lock:
            self._raise_if_ended()

    def _raise_if_ended(self) -> None:
        if self._ended is not None:
            raise EngineUnavailable(f"the engine is not running: {self._ended}")

    def _put(self, command: tuple) -> None:
        with self._lock:
            self._raise_if_ended()
            self._commands.put(command)

    def _put_quietly(self, command: tuple) -> None:
        """Queue a command that is moot once the engine has ended (abort, wake, undo)."""
        with self._lock:
            if self._ended is None:
                self._commands.put(command)

    def _give_up(self, command: _Call) -> bool:
        """The caller stops waiting. Returns whether ``fn`` had started (else it never will)."""
        with self._lock:
            command.withdrawn = not command.started
        command.future.cancel()
        return command.started

    def _settle(self, command: _Call, result: Any, error: BaseException | None) -> None:
        """Event loop: deliver a call's answer, or undo its result if the caller has gone."""
        if not command.future.done():
            if error is not None:
                command.future.set_exception(error)
            else:
                command.future.set_result(result)
        elif error is None and command.undo is not None:
            self._put_quietly(("undo", command.undo, result))

    # --- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the engine was shut down"
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self._engine.has_work())
                busy = self._engine.has_work()
                if self._before_step is not None:
                    self._before_step(busy)
                if not busy:
                    continue
                started = time.perf_counter()
                outputs = self._engine.step()
                if self._on_step is not None:
                    self._on_step(len(outputs), time.perf_counter() - started)
                self._publish(outputs)
        except BaseException as exc:  # never leave anyone waiting: _end answers them all
            log.exception("engine thread died")
            reason = f"engine thread died: {type(exc).__name__}: {exc}"
        finally:
            self._end(reason)

    def _end(self, reason: str) -> None:
        """Mark the engine ended (no command can be queued from now on), then fail everything queued
        and every request stream."""
        with self._lock:
            if self._ended is not None:
                return
            self._ended = reason
            queued = []
            while True:
                try:
                    queued.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            streams = {rid: n for rid, (_, _, n) in self._streams.items()}
        for kind, *args in queued:
            if kind == "call":
                self._answer(args[0], None, EngineUnavailable(f"the engine is not running: {reason}"))
        self._publish([output for rid, n in streams.items() for output in _failed(rid, n, reason)])

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
                first = start(self._engine)
            except Exception as exc:  # checked before queueing; this is a last line of defence
                log.exception("request %s refused", request_id)
                stream = self._streams.get(request_id)
                self._publish(_failed(request_id, stream[2] if stream else 1, str(exc)))
            else:
                if isinstance(first, list):  # add_prefilled: each sequence's first output
                    self._publish(first)
        elif kind == "call":
            self._run_call(args[0])
        elif kind == "abort":
            self._publish(self._engine.abort(args[0]))
        elif kind == "undo":
            undo, result = args
            try:
                undo(self._engine, result)
            except Exception:
                log.exception("undoing a call whose caller gave up failed")

    def _run_call(self, command: _Call) -> None:
        with self._lock:
            if command.withdrawn:
                return
            command.started = True
        try:
            result = command.fn(self._engine)
        except Exception as exc:
            self._answer(command, None, exc)
        except BaseException as exc:  # ends the engine thread; the caller hears why
            self._answer(command, None, EngineUnavailable(f"the engine thread died: {type(exc).__name__}: {exc}"))
            raise
        else:
            self._answer(command, result, None)

    def _answer(self, command: _Call, result: Any, error: BaseException | None) -> None:
        try:
            command.future.get_loop().call_soon_threadsafe(self._settle, command, result, error)
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting
            pass

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand each output to its request's event loop, then yield the CPU so that loop
        runs now (module docstring)."""
        handed = False
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                loop, outputs_queue, _ = stream
                try:
                    loop.call_soon_threadsafe(outputs_queue.put_nowait, output)
                    handed = True
                except RuntimeError:  # that event loop is closed: nobody is reading
                    pass
        if handed:
            os.sched_yield()


def _failed(request_id: str, n: int, error: str) -> list[RequestOutput]:
    """The final outputs of a request's ``n`` sequences that ended with ``error`` outside the engine."""
    return [RequestOutput(request_id, "", [], FinishReason.ABORT, 0, 0, error, index=i) for i in range(n)]
