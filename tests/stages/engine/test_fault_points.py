"""The engine's fault points (``stages.faults.engine.engine_hook``) fire where their descriptions say.

``engine.stall`` delays work that is there: an idle engine (its thread wakes about every
``IDLE_WAIT_S``) leaves it armed, and the first step with a request takes it. Armed on an idle
server, a stall therefore starts with the request it is meant to slow, not at arm time, however
long the client takes to send that request. ``engine.thread_crash`` may fire idle or busy.
In-process: a real ``AsyncEngine`` on the tiny model, its hook recording what the thread says.
"""

from __future__ import annotations

import asyncio

import pytest

from stages.engine.async_engine import IDLE_WAIT_S, AsyncEngine
from stages.engine.config import EngineConfig
from stages.engine.sampling_params import SamplingParams
from stages.faults.engine import engine_hook
from stages.faults.points import Fault, Faults
from stages.loading import load_engine
from tests.support.generated_models import model_dir


def armed(faults: Faults) -> dict[str, int]:
    return {f["point"]: f["times"] for f in faults.armed()}


@pytest.mark.unit
def test_a_stall_is_taken_only_before_a_step_with_work():
    faults = Faults()
    hook = engine_hook(faults)
    faults.arm(Fault("engine.stall", times=2, delay_s=0.0))
    for _ in range(5):
        hook(False)  # idle wake-ups
    assert armed(faults) == {"engine.stall": 2}
    hook(True)
    assert armed(faults) == {"engine.stall": 1}
    faults.arm(Fault("engine.thread_crash"))
    with pytest.raises(RuntimeError, match="fault point engine.thread_crash"):
        hook(False)  # a crash needs no work


async def test_the_engine_thread_says_busy_right_before_each_step_and_idle_otherwise():
    engine, prompts = load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16), pixels=True)
    seen: list[bool] = []
    steps: list[int] = []
    async_engine = AsyncEngine(engine, on_step=lambda size, _: steps.append(size),
                               before_step=seen.append)
    async_engine.start()
    try:
        await asyncio.sleep(2.5 * IDLE_WAIT_S)
        idle = list(seen)
        assert len(idle) >= 2 and not any(idle)  # woken while idle, never busy
        prompt = prompts.build([{"role": "user", "content": "hi"}], [])
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outputs = [o async for o in async_engine.generate("one", prompt, params)]
        assert outputs[-1].finished and outputs[-1].error is None
        # one busy call before each step (the prefill's and 2 decodes'), none while it idled
        assert len(steps) >= 3 and sum(seen[len(idle):]) == len(steps)
    finally:
        async_engine.shutdown()
