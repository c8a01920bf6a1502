"""Network faults between prefills and decodes on the rig (issue 16, item 3), every deadline flag at its
default (``fault_helpers.start_default_stack``: 2P2D over Mooncake, no encoder), 8 concurrent streams
through the router from the client host:

- d1's host vanishes mid-stream (its link cut): every stream ends within 10 s (its text, or an error
  naming the decode); the others keep serving; once the link is back, d1 is readmitted and serves
  within 30 s.
- p1's host vanishes during the KV write (its Mooncake traffic held by an nft drop until the first
  write is on the wire, then its link cut): every client has its answer, text or 502/504 naming the
  prefill, within 10 s; requests meanwhile succeed on the other pair; the decode frees the reserved
  blocks.
- p1's bootstrap port rejects (an nft TCP reset): every request ends within 10 s, its text or an error
  naming the prefill (the router retries the rooms that met the reset); the other pair serves.
After each test: KV blocks back to 0 on every P and D, every worker healthy with a closed breaker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.multihost.fault_helpers import CONCURRENT, DEADLINE_S, READMIT_S, Answer, assert_ok_or_naming, \
    blocks_used, chat, client_of, in_rotation, retries, start_default_stack, wait_until, \
    worker_metric
from tests.multihost.rig import BOOTSTRAP_PORT
from tests.multihost.stack import MOONCAKE_PORTS, Stack, pair_of

pytestmark = pytest.mark.timeout(240)
LONG = 600  # tokens of a stream that is still running when its decode vanishes
# a decode frees an aborted room's blocks on the prefill's last word, at most 5 s (--peer-idle-timeout-s)
# + 30 s (--abort-grace-s) after the abort
ABORT_FREED_S = 5 + 30 + 5


@pytest.fixture(scope="module")
def stack(make_rig) -> Stack:
    return start_default_stack(make_rig(4), encoders=())


@pytest.fixture(autouse=True)
def clean(stack: Stack) -> Iterator[None]:
    rig = stack.rig
    rig.client(wait_until, lambda: all(in_rotation(stack.router, role, w) for role, group in
                                       (("prefill", stack.prefills), ("decode", stack.decodes)) for w in group),
               READMIT_S, "every worker in rotation")
    yield
    rig.client(wait_until, lambda: not any(blocks_used([*stack.prefills, *stack.decodes])), ABORT_FREED_S,
               "KV blocks back to 0 on p1, p2, d1, d2")


def _served_by(stack: Stack, host: str, tries: int = 4) -> bool:
    """One of ``tries`` requests through the router is served by the stage on ``host``."""
    body = {"messages": [{"role": "user", "content": "are you back?"}], "max_tokens": 4, "temperature": 0}
    return any(host in pair_of(stack, body)[0] for _ in range(tries))


def test_a_decode_host_that_vanishes_mid_stream(stack):
    rig, victim = stack.rig, stack.decodes[0]

    async def scenario() -> tuple[list[Answer], list[Answer], float]:
        async with client_of(stack) as (client, model):
            started = [asyncio.Event() for _ in range(CONCURRENT)]
            first = [asyncio.create_task(chat(client, model, f"vanishing decode {i}", max_tokens=LONG, ignore_eos=True,
                                              first=started[i])) for i in range(CONCURRENT)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 20)  # text reached the client
            rig.cut("d1")
            cut_at = time.monotonic()
            answers = await asyncio.gather(*first)
            later = await asyncio.gather(*(chat(client, model, f"meanwhile {i}") for i in range(CONCURRENT)))
            return answers, later, cut_at

    try:
        answers, later, cut_at = rig.client_async(scenario)
    finally:
        rig.restore("d1")
    restored_at = time.monotonic()
    # the streams on d1 had sent text, so none can be retried: each ends with an error naming d1 within 10 s
    errors = [a for a in answers if a.error is not None]
    assert len(errors) == CONCURRENT // 2, [(a.seconds, a.message) for a in answers]
    assert all(a.ended_at - cut_at < DEADLINE_S for a in errors), [a.ended_at - cut_at for a in errors]
    assert_ok_or_naming(errors, "decode", victim, within_s=60)
    assert all(len(a.text or "") > 0 for a in answers if a.error is None)  # d2's streams ran to their end
    assert all(a.error is None and a.text for a in later), [(a.seconds, a.message) for a in later]
    assert all(a.seconds < DEADLINE_S for a in later)
    rig.client(wait_until, lambda: in_rotation(stack.router, "decode", victim), READMIT_S, "d1 readmitted")
    assert _served_by(stack, "d1")
    assert time.monotonic() - restored_at < READMIT_S
    assert rig.client(worker_metric, stack.router, "epd_router_circuit_state", "decode", victim) == 0.0


def test_a_prefill_host_that_vanishes_during_the_kv_write(stack):
    """p1's Mooncake traffic is dropped on its way out (nft, output chain, the library's port range), so
    its rooms pair, compute and start their KV writes, which hang on the wire; once the first write's
    packets met the rule, p1's link is cut: the decodes hold accepted rooms whose prefill went silent."""
    rig, victim = stack.rig, stack.prefills[0]
    mooncake = "{}-{}".format(*MOONCAKE_PORTS)

    async def scenario() -> tuple[list[Answer], list[Answer], float, list[int]]:
        async with client_of(stack) as (client, model):
            first = [asyncio.create_task(chat(client, model, f"vanishing prefill {i}", max_tokens=16))
                     for i in range(CONCURRENT)]
            await asyncio.to_thread(wait_until, lambda: rig.blocked_packets("p1", mooncake) > 0 and worker_metric(
                stack.router, "epd_router_worker_outstanding_requests", "prefill", victim) == CONCURRENT // 2,
                DEADLINE_S, "p1's rooms are writing their KV")
            rig.cut("p1")
            cut_at = time.monotonic()
            answers = await asyncio.gather(*first)
            ended = time.monotonic() - cut_at
            meanwhile = await asyncio.gather(*(chat(client, model, f"meanwhile {i}") for i in range(CONCURRENT)))
            return answers, meanwhile, ended, blocks_used(stack.decodes)

    retried = rig.client(retries, stack.router, "prefill")
    rig.block("p1", mooncake, "drop", chain="output")
    try:
        answers, meanwhile, ended, held = rig.client_async(scenario)
        retried = rig.client(retries, stack.router, "prefill") - retried
        # the decode frees the failed rooms' blocks with p1 still gone (5 s idle + --abort-grace-s at most)
        freed = rig.client(wait_until, lambda: not any(blocks_used(stack.decodes)), ABORT_FREED_S,
                           "the decodes freed the blocks of p1's rooms")
    finally:
        rig.unblock("p1", mooncake)
        rig.restore("p1")
    assert ended < DEADLINE_S, [(a.seconds, a.message) for a in answers]
    failed = [a for a in answers if a.error is not None]
    # each of p1's rooms ended: retried on the other pair (nothing had reached its client) or an error
    assert len(failed) + retried >= CONCURRENT // 2, (retried, [(a.seconds, a.message) for a in answers])
    assert all(a.status in (502, 504) for a in failed), [(a.status, a.message) for a in failed]
    assert_ok_or_naming(answers, "prefill", victim, within_s=DEADLINE_S + 10)
    assert all(a.error is None and a.text and a.seconds < DEADLINE_S for a in meanwhile), \
        [(a.seconds, a.message) for a in meanwhile]
    print(f"{retried:g} retried, {len(failed)} failed; blocks held after the first wave {held}; freed {freed:.1f} s "
          "later")


def test_a_prefill_bootstrap_port_that_rejects(stack):
    """Every TCP packet to p1's bootstrap port is answered by a reset: decodes paired with p1 cannot
    reach it (an open link is reset, a new one refused), so its rooms fail fast and the router retries
    them on a fresh pair or answers an error naming the prefill."""
    rig, victim = stack.rig, stack.prefills[0]
    retried = rig.client(retries, stack.router, "prefill")
    rig.block("p1", BOOTSTRAP_PORT, "reject")
    try:
        async def scenario() -> list[Answer]:
            async with client_of(stack) as (client, model):
                return await asyncio.gather(*(chat(client, model, f"rejected bootstrap {i}", max_tokens=8)
                                              for i in range(CONCURRENT)))

        answers = rig.client_async(scenario)
        later = rig.client_async(scenario)
    finally:
        assert rig.unblock("p1", BOOTSTRAP_PORT) == 1
    assert_ok_or_naming([*answers, *later], "prefill", victim)
    assert rig.client(retries, stack.router, "prefill") > retried  # the reset was met, and retried
