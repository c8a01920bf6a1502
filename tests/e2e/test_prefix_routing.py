"""``--policy-colocated prefix_aware`` for real: a router process in front of two colocated servers.
Conversations whose history grows turn by turn each stay on one worker, and different conversations
spread over both; which worker served each request is read from the workers' own ``/metrics``; every
later turn finds the earlier turn's full KV blocks in that worker's prefix cache (the answer's
``cached_tokens``); and the router's prefix metrics count exactly the characters the test computes."""

from __future__ import annotations

import time

import httpx
import pytest

from router.plan.prefix_tree import Prefix, chat_units
from tests.support.router_helpers import metric, wait_metric

pytestmark = pytest.mark.timeout(240)
BLOCK = 16  # the engine's default --block-size: its prefix cache holds a prompt's full blocks
CONVERSATIONS, TURNS = 3, 3  # odd: a policy blind to the prefix, alternating, would move them


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    model = str(tiny_model("qwen2_vl"))
    return [start_server("colocated", "--model", model, "--kv-cache-mib", "16") for _ in range(2)]


@pytest.fixture(scope="module")
def router(start_server, workers):
    return start_server("router", *[flag for w in workers for flag in ("--colocated", w.url)],
                        "--policy-colocated", "prefix_aware", "--health-interval-s", "0.5")


def served(url: str) -> float:
    """Chat requests the worker finished, every finish reason."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("epd_requests_total{"))


def chat(router_url: str, workers, model: str, messages: list[dict]) -> tuple[dict, int]:
    """The answer and the index of the worker that served it (its finished count moved by one)."""
    before = [served(w.url) for w in workers]
    response = httpx.post(f"{router_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 5
    while (moved := [served(w.url) - b for w, b in zip(workers, before)]) == [0, 0]:
        assert time.monotonic() < deadline, "no worker counted the request"
        time.sleep(0.05)
    assert sorted(moved) == [0, 1], moved
    return response.json(), moved.index(1)


def test_each_conversation_sticks_to_one_worker_and_conversations_spread(router, workers):
    model = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
    histories = [[{"role": "system", "content": f"Conversation {c}: talk about topic {c}. " * 8}]
                 for c in range(CONVERSATIONS)]
    placed: dict[int, list[int]] = {c: [] for c in range(CONVERSATIONS)}
    request_chars = match_chars = 0
    previous: dict[int, int] = {}  # each conversation's last request, in characters
    prompts: dict[int, int] = {}  # and in prompt tokens
    for turn in range(TURNS):  # the conversations interleave, as concurrent clients' turns would
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": f"question {turn}"})
            answer, worker = chat(router.url, workers, model, history)
            placed[c].append(worker)
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == prompts.get(c, 0) // BLOCK * BLOCK, (c, turn, answer["usage"])
            prompts[c] = answer["usage"]["prompt_tokens"]
            total = Prefix.of(chat_units({"messages": history})).total
            match_chars += previous.get(c, 0)  # the conversation's last request is a prefix of this one
            request_chars += total
            previous[c] = total
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    assert all(len(set(where)) == 1 for where in placed.values()), placed
    assert sorted(where[0] for where in placed.values()) == [0, 0, 1]  # the smaller tree takes the next
    wait_metric(router.url, 'epd_router_requests_total{outcome="success"}', CONVERSATIONS * TURNS)
    assert metric(router.url, 'epd_router_prefix_routes_total{by="spread"}') == CONVERSATIONS
    assert metric(router.url, 'epd_router_prefix_routes_total{by="match"}') == CONVERSATIONS * (TURNS - 1)
    assert metric(router.url, 'epd_router_prefix_routes_total{by="load"}') == 0
    assert metric(router.url, "epd_router_prefix_request_chars_total") == request_chars
    assert metric(router.url, "epd_router_prefix_match_chars_total") == match_chars
