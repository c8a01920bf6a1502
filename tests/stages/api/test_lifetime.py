"""A request's lifetime guard (stages/api/lifetime.py): an engine that dies under a request fails
it with a 503 instead of leaving it hanging, and the request is aborted. No model."""

from __future__ import annotations

import asyncio

import pytest

from stages.api import lifetime
from stages.api.errors import APIError
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from tests.support.stage_api import FakeAsyncEngine

pytestmark = pytest.mark.unit


def test_engine_dying_mid_request_fails_it_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(lifetime, "LIVENESS_CHECK_S", 0.02)
    engine = FakeAsyncEngine(lambda rid, prompt: iter([RequestOutput(rid, "partial", [1], None, 4, 1)]))
    engine.hang = True  # after its first output the request waits forever, as if the engine thread had died

    async def run() -> None:
        outputs = lifetime.guarded(engine, engine.generate("r1", Prompt([1, 2]), None))
        assert (await anext(outputs)).text == "partial"
        engine.alive = False
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(anext(outputs), timeout=5)
        assert info.value.status == 503

    asyncio.run(run())
    assert engine.aborted == ["r1"]
