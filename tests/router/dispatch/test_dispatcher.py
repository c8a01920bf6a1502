"""The dispatcher (router/dispatch/dispatcher.py) against a scripted planner: a breaker that opens
while planning sends the request elsewhere, the plan's claims released. In-process: no sockets."""

from __future__ import annotations

import asyncio

import pytest

from router.config import RouterConfig
from router.dispatch.dispatcher import Dispatcher
from router.dispatch.timeline import RoomLog
from router.errors import RouterError
from router.metrics import Metrics
from router.plan.modes import Call, Plan, Target
from tests.support.router_workers import worker

pytestmark = pytest.mark.unit

P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


async def test_a_breaker_that_opens_while_planning_sends_the_request_elsewhere():
    """The pick saw a closed circuit; by the time the plan returns (an epd plan awaits the cache) it
    opened. The dispatcher begins nothing on it: it drops the plan (its encoders' claims released)
    and plans again without that worker; none left: 503 no_healthy_worker, never a RuntimeError."""
    e, p, d = worker("http://e:1", "encoder"), worker("http://p:1", "prefill"), worker("http://d:1", "decode")
    excluded: list[set[str]] = []
    released: list[frozenset[str]] = []

    async def on_abort(urls: frozenset[str]) -> None:
        released.append(urls)

    class Planner:
        async def plan(self, call: Call, exclude) -> Plan:
            excluded.append(set(exclude))
            if exclude:
                raise RouterError(503, "no prefill", code="no_healthy_worker")
            p.breaker.begin()
            p.breaker.failure()  # opened meanwhile
            return Plan(Target("decode", d, b""), (Target("encoder", e, b""), Target("prefill", p, b"")), room=1,
                        on_abort=on_abort)

    metrics = Metrics()
    config = RouterConfig(prefill=(P,), decode=(D,))
    dispatcher = Dispatcher(config, Planner(), None, metrics, RoomLog(8))
    with pytest.raises(RouterError) as error:
        await dispatcher.handle(None, Call({}, False, None, 0.0))
    assert (error.value.status, error.value.code) == (503, "no_healthy_worker")
    assert excluded == [set(), {"http://p:1"}]
    await asyncio.gather(*dispatcher._background)
    assert released == [frozenset({"http://e:1"})]
    assert (e.outstanding, p.outstanding, d.outstanding) == (0, 0, 0) and e.breaker.allows() and d.breaker.allows()
    assert len(dispatcher.rooms) == 0  # never sent: no room recorded
