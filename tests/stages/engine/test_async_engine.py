"""AsyncEngine: nobody waits forever on the engine thread.

In-process (real Engine, tiny model): the engine thread is killed or stalled through its
``before_step`` hook while calls and request streams wait; every caller hears at once (calls queued
before the death, and calls and streams issued after it) or at its deadline (a stuck engine).
Against a real `stage serve colocated --debug-faults` subprocess: the ``engine.thread_crash`` fault
point answers every in-flight client within a second or two and turns /health 503.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stages.engine.async_engine import AsyncEngine, EngineTimeout, EngineUnavailable
from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.outputs import RequestOutput
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from tests.support.generated_models import model_dir

CRASH = "engine thread died: RuntimeError: injected engine crash"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# "at once": far below any call's own deadline (30 s here), with room for a loaded core to schedule us
ANSWERED_S = 5.0


class Hook:
    """A ``before_step`` hook the test drives: holds the engine thread while ``hold`` is set (saying
    so through ``holding``), raises once ``crash`` is set."""

    def __init__(self) -> None:
        self.hold, self.holding, self.crash = threading.Event(), threading.Event(), threading.Event()
        self.release = threading.Event()

    def __call__(self, busy: bool) -> None:
        if self.hold.is_set():
            self.holding.set()
            self.release.wait(10)
        if self.crash.is_set():
            raise RuntimeError("injected engine crash")


@pytest.fixture
def loaded():
    return load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16), pixels=True)


@pytest.fixture
def engine(loaded) -> Engine:
    return loaded[0]


@pytest.fixture
def prompt(loaded):
    return loaded[1].build([{"role": "user", "content": "tell me a story"}], [])


async def collect(outputs) -> list[RequestOutput]:
    return [output async for output in outputs]


async def test_a_dead_engine_thread_answers_every_waiting_caller_at_once(engine, prompt):
    hook = Hook()
    async_engine = AsyncEngine(engine, before_step=hook)
    async_engine.start()
    running = [async_engine.generate(f"running-{i}", prompt, GREEDY) for i in range(2)]
    firsts = [await anext(stream) for stream in running]  # in the engine, decoding
    assert all(o.error is None and not o.finished for o in firsts)
    hook.hold.set()
    assert await asyncio.to_thread(hook.holding.wait, 5)
    ran: list[int] = []
    calls = [asyncio.ensure_future(async_engine.call(lambda e, i=i: ran.append(i))) for i in range(3)]
    queued = [asyncio.ensure_future(collect(async_engine.generate(f"queued-{i}", prompt, GREEDY))) for i in range(3)]
    rest = [asyncio.ensure_future(collect(stream)) for stream in running]
    await asyncio.sleep(0.1)  # every call and stream is in the command queue now
    assert not any(task.done() for task in calls + queued + rest)

    hook.crash.set()
    hook.release.set()
    started = time.monotonic()
    done, pending = await asyncio.wait(calls + queued + rest, timeout=ANSWERED_S)
    assert not pending and time.monotonic() - started < ANSWERED_S
    for call in calls:
        with pytest.raises(EngineUnavailable, match=f"the engine is not running: {CRASH}"):
            call.result()
    assert ran == []  # queued calls never ran
    for task in queued + rest:
        assert [(o.finish_reason, o.error) for o in task.result()][-1:] == [(FinishReason.ABORT, CRASH)]
    assert not async_engine.alive

    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match=CRASH):
        await async_engine.call(lambda e: 1)
    with pytest.raises(EngineUnavailable, match=CRASH):
        async_engine.generate("late", prompt, GREEDY)
    with pytest.raises(EngineUnavailable, match=CRASH):
        async_engine.generate_prefilled(Prefilled("late", prompt, GREEDY, [0], FirstTokens([1])))
    assert time.monotonic() - started < ANSWERED_S


async def test_calls_racing_the_engine_thread_death_all_get_an_answer(engine):
    """A call put just before, during or after the final drain is answered, never left waiting."""
    for round_ in range(20):
        hook = Hook()
        async_engine = AsyncEngine(engine, before_step=hook)
        async_engine.start()
        tasks = [asyncio.ensure_future(async_engine.call(lambda e: 1, timeout_s=30))]
        threading.Timer(0.002 * (round_ % 5), hook.crash.set).start()
        deadline = time.monotonic() + 2
        while async_engine.alive and time.monotonic() < deadline:
            tasks.append(asyncio.ensure_future(async_engine.call(lambda e: 1, timeout_s=30)))
            await asyncio.sleep(0)
        died = time.monotonic()
        # each call's own deadline is 30 s: answered within ANSWERED_S means the death answered it
        done, pending = await asyncio.wait(tasks, timeout=ANSWERED_S)
        assert not pending, f"round {round_}: {len(pending)} calls left waiting after the engine died"
        assert time.monotonic() - died < ANSWERED_S
        answers = {task.result() if task.exception() is None else type(task.exception()) for task in tasks}
        assert answers <= {1, EngineUnavailable}
        with pytest.raises(EngineUnavailable, match=CRASH):
            await async_engine.call(lambda e: 1)


async def test_a_call_to_a_stuck_engine_times_out_at_its_deadline_and_never_runs(engine):
    hook = Hook()
    hook.hold.set()
    async_engine = AsyncEngine(engine, before_step=hook)
    async_engine.start()
    assert await asyncio.to_thread(hook.holding.wait, 5)
    ran: list[str] = []
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match="did not answer within 0.3 s; the call was withdrawn and did not run"):
        await async_engine.call(lambda e: ran.append("late"), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 0.8
    assert isinstance(EngineTimeout("x"), TimeoutError) and issubclass(EngineTimeout, EngineUnavailable)
    hook.hold.clear()
    hook.release.set()
    assert await async_engine.call(lambda e: "next", timeout_s=5) == "next"
    assert ran == []  # the withdrawn call was skipped, not run late
    async_engine.shutdown()
    with pytest.raises(EngineUnavailable, match="the engine is not running: the engine was shut down"):
        await async_engine.call(lambda e: 1)


async def test_a_call_that_runs_past_its_deadline_is_undone(loaded):
    """``fn`` started before the deadline and returned after it: ``undo`` gets its result."""
    engine, prompts = loaded
    async_engine = AsyncEngine(engine)
    async_engine.start()
    prompt = prompts.build([{"role": "user", "content": "hi"}], [])

    def slow_reserve(e: Engine) -> list[int]:
        time.sleep(0.5)
        return e.reserve_blocks(prompt, GREEDY)

    with pytest.raises(EngineTimeout, match="ran late and its result was dropped"):
        await async_engine.call(slow_reserve, timeout_s=0.1, undo=lambda e, blocks: e.free_blocks(blocks))
    for _ in range(40):  # the undo is queued once the late result reaches the event loop
        if await async_engine.call(lambda e: e.allocator.num_used, timeout_s=5) == 0:
            break
        await asyncio.sleep(0.05)
    assert await async_engine.call(lambda e: e.allocator.num_used, timeout_s=5) == 0
    async_engine.shutdown()


# --- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")), "--max-model-len", "2048",
                        "--kv-cache-mib", "32", "--threads", "1", "--debug-faults")


def chat(url: str, stream: bool) -> tuple[float, int, dict]:
    """One long request; returns when it ended, its status and its error body (in-band for a stream)."""
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=30) as http:
        if not stream:
            response = http.post(f"{url}/v1/chat/completions", json=body)
            return time.monotonic(), response.status_code, response.json()
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return time.monotonic(), response.status_code, events[-1]


def test_engine_thread_crash_answers_in_flight_clients_and_turns_health_503(server):
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, server.url, stream=i % 2 == 0) for i in range(6)]
        time.sleep(1.0)  # all six are in the engine, decoding their 2000 tokens
        assert not any(f.done() for f in futures), "the requests ended before the fault was armed"
        armed_at = time.monotonic()
        armed = httpx.post(f"{server.url}/debug/faults", json={"point": "engine.thread_crash"}, timeout=5)
        assert armed.status_code == 200
        results = [f.result(timeout=10) for f in futures]
    message = "The engine failed on this request: engine thread died: RuntimeError: fault point engine.thread_crash"
    for i, (ended_at, status, error) in enumerate(results):
        assert ended_at - armed_at < 2.0
        assert status == (200 if i % 2 == 0 else 500)  # a stream has sent its 200: the error comes in-band
        assert error["error"]["message"] == message and error["error"]["code"] == "engine_error"
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503
    assert health.json()["error"]["message"] == ("This server is unhealthy and should be restarted: "
                                                 "engine thread: thread is not running")
    late = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=5)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"
