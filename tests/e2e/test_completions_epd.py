"""``/v1/completions`` through a router in epd mode (Redis, an encoder, an EPD prefill and decode over
Mooncake): a text prompt takes the pd plan (no image, no encoder call) and answers what a colocated
server does, stream and not, echo with logprobs too."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from cache.config import MIB
from cache.embedded import EmbeddedRedis
from tests.support.epd_helpers import start_epd

pytestmark = pytest.mark.timeout(300)
FLAGS = ("--pair-timeout-s", "5", "--transfer-timeout-s", "5")


@pytest.fixture(scope="module")
def servers(start_server, tiny_model, tmp_path_factory):
    """(an epd router, a colocated server of the same model)."""
    redis = EmbeddedRedis(64 * MIB).start()
    with ThreadPoolExecutor(1) as pool:
        colocated = pool.submit(start_server, "colocated", "--model", str(tiny_model("qwen2_vl")),
                                "--kv-cache-mib", "16")
        epd = start_epd("qwen2_vl", "mooncake", redis.url, tmp_path_factory.mktemp("epd-logs"), prefill_flags=FLAGS,
                        decode_flags=(*FLAGS, "--kv-timeout-s", "15"))
        try:
            router = start_server("router", "--encoder", epd.encoders[0].url, "--prefill", epd.prefill.url,
                                  "--decode", epd.decode.url, "--redis-url", redis.url, "--upstream-timeout-s", "30")
            yield router, colocated.result()
        finally:
            epd.stop()
            redis.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_text_completions_through_epd_equal_colocated(servers):
    router, colocated = servers
    model = client(colocated).models.list().data[0].id
    kwargs = dict(model=model, prompt="Through every stage", max_tokens=6, temperature=0, logprobs=1, echo=True,
                  n=2, extra_body={"ignore_eos": True})
    expected = client(colocated).completions.create(**kwargs)
    routed = client(router).completions.create(**kwargs)
    assert [c.text for c in routed.choices] == [c.text for c in expected.choices]
    for mine, theirs in zip(routed.choices, expected.choices):
        assert mine.logprobs.tokens == theirs.logprobs.tokens
        assert mine.logprobs.token_logprobs[1:] == pytest.approx(theirs.logprobs.token_logprobs[1:], abs=1e-4)
    texts: dict[int, str] = {}
    for piece in client(router).completions.create(stream=True, **kwargs):
        for c in piece.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in expected.choices}
