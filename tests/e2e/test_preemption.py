"""KV on demand on real servers: a colocated server whose 1 MiB pool (128 blocks of 16 tokens) runs dry
preempts (recompute), counts it in /metrics and gives every block back; a request that cannot fit
even alone gets a 400 naming the pool at once; a 1P1D decode with a 1 MiB pool swaps requests to the
host and back, and answers exactly as an engine whose pool never runs dry."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stages.engine.config import EngineConfig
from stages.engine.sampling_params import SamplingParams
from process.ports import free_port
from stages.loading import load_engine
from tests.conftest import launch
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image
from tests.support.pd_pair import png_url, wait_blocks_free
from tests.support.prom_samples import metrics

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 560  # 5 requests of ~600 tokens at their longest: ~2.5x the 2048 slots of a 1 MiB pool
# (images' sizes, words)
CASES = [([], 3), ([(64, 64)], 2), ([], 8), ([(96, 64)], 1), ([(64, 64), (32, 48)], 2)]


def body(index: int, **extra) -> dict:
    sizes, words = CASES[index]
    parts = [{"type": "image_url", "image_url": {"url": png_url(w, h, index * 10 + i)}} for i, (w, h) in enumerate(sizes)]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "say more " * words}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=b) for b in bodies))


@pytest.fixture(scope="module")
def colocated(start_server):
    return start_server("colocated", "--model", str(model_dir("qwen2_vl")), "--kv-cache-mib", "1",
                        "--max-model-len", "4096")


async def test_a_colocated_pool_that_runs_dry_preempts_counts_it_and_frees_every_block(colocated):
    answers = await post_all(colocated.url, [body(i) for i in range(len(CASES))])
    assert [a.status_code for a in answers] == [200] * len(CASES), [a.text for a in answers]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [MAX_TOKENS] * len(CASES)
    with httpx.Client(base_url=colocated.url, timeout=10) as http:
        after = metrics(http)
    assert after['epd_preemptions_total{kind="recompute"}'] > 0 and after['epd_preemptions_total{kind="swap"}'] == 0
    assert (after["epd_kv_blocks_used"], after["epd_kv_blocks_total"], after["epd_running_requests"]) == (0, 128, 0)


async def test_a_request_that_cannot_fit_alone_is_refused_with_the_pool_named(colocated):
    (probe,) = await post_all(colocated.url, [body(0, max_tokens=1)])
    prompt = probe.json()["usage"]["prompt_tokens"]
    max_tokens = 2048 - prompt + 2  # prompt + max_tokens - 1 = 2049 slots: one more than the pool's 2048
    (answer,) = await post_all(colocated.url, [body(0, max_tokens=max_tokens)])
    assert answer.status_code == 400
    assert answer.json() == {"error": {
        "message": f"request needs 129 KV blocks (prompt {prompt} + max_tokens {max_tokens}) but the pool has 128; "
                   "lower max_tokens or start the server with a larger --kv-cache-mib",
        "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value", "stage": "colocated"}}
    (fits,) = await post_all(colocated.url, [body(0, max_tokens=max_tokens - 1)])  # exactly the pool: runs alone
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == max_tokens - 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = str(model_dir("qwen3_vl"))  # M-RoPE and deepstack: a decode could not recompute its images
    bootstrap = free_port()
    logs = tmp_path_factory.mktemp("pd-swap")
    common = ["--model", path, "--transfer", "mooncake"]
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda job: launch(*job), [
            ("prefill", [*common, "--kv-cache-mib", "16", "--bootstrap-port", str(bootstrap)],
             logs / "prefill.log", 180.0, None),
            ("decode", [*common, "--kv-cache-mib", "1"], logs / "decode.log", 180.0, None),
        ])
    yield path, prefill, decode, bootstrap
    prefill.stop()
    decode.stop()


def reference_texts(path: str) -> list[str]:
    """Each case's greedy text from an in-process engine whose pool never runs dry (PD equals colocated:
    tests/e2e/test_pd_parity.py)."""
    engine, builder = load_engine(EngineConfig(model=path, kv_cache_mib=8, device=DEVICE), pixels=True)
    texts = {}
    for i, (sizes, words) in enumerate(CASES):
        images = [random_image(w, h, i * 10 + k) for k, (w, h) in enumerate(sizes)]
        prompt = builder.build([{"role": "user", "content": [{"type": "image"} for _ in images]
                                 + [{"type": "text", "text": "say more " * words}]}], images)
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        texts[str(i)] = ""
    for _ in range(2 * MAX_TOKENS):
        if not engine.has_work():
            break
        for output in engine.step():
            texts[output.request_id] += output.text
    assert not engine.has_work() and engine.scheduler.preemptions == {"recompute": 0, "swap": 0}
    return [texts[str(i)] for i in range(len(CASES))]


async def test_a_pd_decode_that_runs_dry_swaps_and_answers_as_a_pool_that_never_does(pair):
    path, prefill, decode, bootstrap = pair
    bodies = [body(i, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap, bootstrap_room=random.getrandbits(63))
              for i in range(len(CASES))]
    async with httpx.AsyncClient(timeout=120) as client:
        sent = [client.post(f"{server.url}/v1/chat/completions", json=b) for b in bodies
                for server in (prefill, decode)]
        answers = await asyncio.gather(*sent)
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers]
    decoded = [a.json()["choices"][0]["message"]["content"] for a in answers[1::2]]
    with httpx.Client(base_url=decode.url, timeout=10) as http:
        after = metrics(http)
    assert after['epd_preemptions_total{kind="swap"}'] > 0 and after['epd_preemptions_total{kind="recompute"}'] == 0
    expected = await asyncio.to_thread(reference_texts, path)
    if on_gpu():
        assert [d[:20] for d in decoded] == [e[:20] for e in expected]
    else:
        assert decoded == expected
    await asyncio.to_thread(wait_blocks_free, prefill, decode)  # bounded: 10 s
