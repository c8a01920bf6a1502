"""``--generation-config auto`` (the default) held to Hugging Face ``generate()``: a checkpoint whose
``generation_config.json`` sets do_sample, top_k 1 (so sampling is deterministic), temperature 0.7, a
repetition penalty of 1.5 and max_new_tokens, served with default flags colocated, as a PD pair and as
E+P+D, answers a request that sets no sampling field (nor max_tokens) with exactly the tokens
``model.generate(**inputs)`` gives, which applies that file, and not plain greedy decoding's. A decode
started with ``--generation-config none`` beside an ``auto`` prefill is refused, naming the flag, and
every server lists its defaults in ``/server_info``."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image as PILImage

from process.ports import free_port
from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from tests.conftest import launch
from tests.support.devices import DEVICE
from tests.support.epd_helpers import Image, start_epd
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_inputs, load_reference
from tests.support.pd_pair import Pair, png_url
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)
GENERATION = {"do_sample": True, "top_k": 1, "temperature": 0.7, "repetition_penalty": 1.5, "max_new_tokens": 8}
DEFAULTS = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.5, "max_tokens": 8}  # the API's names
TEXT = "say it again and again: again, again"
SIZE = (64, 64)  # one image, seed 0: the same pixels in every mode


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The generated qwen2_vl checkpoint with the sampling defaults added to its generation_config.json."""
    path = tmp_path_factory.mktemp("generation-config") / "qwen2_vl-sampling"
    shutil.copytree(model_dir("qwen2_vl"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **GENERATION}))
    return path


@pytest.fixture(scope="module")
def servers(checkpoint, redis_server, tmp_path_factory):  # noqa: F811
    """{"colocated", "prefill", "decode", "decode_none": ServerProcess, "bootstrap": int, "epd": EPD}, all
    started at once with default flags but the KV pool's size and short pairing deadlines."""
    logs, path, bootstrap = tmp_path_factory.mktemp("generation-config-logs"), str(checkpoint), free_port()
    pd = ["--model", path, "--transfer", "mooncake", "--kv-cache-mib", "16", "--pair-timeout-s", "3",
          "--transfer-timeout-s", "3"]
    jobs = {"colocated": ("colocated", ["--model", path, "--kv-cache-mib", "16"]),
            "prefill": ("prefill", [*pd, "--bootstrap-port", str(bootstrap)]),
            "decode": ("decode", pd), "decode_none": ("decode", [*pd, "--generation-config", "none"])}
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        epd = pool.submit(start_epd, "qwen2_vl", "mooncake", redis_server.url, tmp_path_factory.mktemp("epd-logs"),
                          path=checkpoint)
        started = {name: pool.submit(launch, role, flags, logs / f"{name}.log", 180.0)
                   for name, (role, flags) in jobs.items()}
    try:
        yield {**{name: future.result() for name, future in started.items()}, "bootstrap": bootstrap,
               "epd": epd.result()}
    finally:
        for future in started.values():
            if future.exception() is None:
                future.result().stop()
        if epd.exception() is None:
            epd.result().stop()


@pytest.fixture(scope="module")
def expected(checkpoint):
    """(generate()'s tokens under the file's defaults, plain greedy's, the tokenizer), for the prompt
    of the one image and ``TEXT``."""
    adapter = load_adapter(checkpoint, torch.float32, "sdpa", device=DEVICE)
    prompts = PromptBuilder.load(checkpoint, adapter)
    image = PILImage.open(io.BytesIO(Image.random(*SIZE, seed=0).data))
    prompt = prompts.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}], [image])
    model, inputs = load_reference(checkpoint), hf_inputs(prompt, adapter.image_token_id)
    assert model.generation_config.repetition_penalty == 1.5  # generate() reads the file
    with torch.inference_mode():
        sampled = model.generate(**inputs)[0, inputs["input_ids"].shape[1]:].tolist()
        greedy = model.generate(**inputs, do_sample=False, repetition_penalty=1.0)[0, inputs["input_ids"].shape[1]:]
    return sampled, greedy.tolist(), prompts.tokenizer


def body() -> dict:
    """A chat request that sets no sampling field and no max_tokens."""
    parts = [{"type": "image_url", "image_url": {"url": png_url(*SIZE, 0)}}, {"type": "text", "text": TEXT}]
    return {"messages": [{"role": "user", "content": parts}]}


def check_answer(answer: httpx.Response, expected) -> None:
    tokens, greedy, tokenizer = expected
    assert answer.status_code == 200, answer.text
    text = answer.json()["choices"][0]["message"]["content"]
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert answer.json()["usage"]["completion_tokens"] == len(tokens) <= GENERATION["max_new_tokens"]
    assert text != tokenizer.decode(greedy, skip_special_tokens=True)  # the penalty changed the answer


def test_the_generate_reference_has_teeth(expected):
    sampled, greedy, _ = expected
    assert len(sampled) == GENERATION["max_new_tokens"] and sampled != greedy


def test_colocated_applies_the_checkpoints_defaults(servers, expected):
    check_answer(httpx.post(f"{servers['colocated'].url}/v1/chat/completions", json=body(), timeout=60), expected)


async def test_pd_applies_the_checkpoints_defaults(servers, expected):
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await Pair(servers["prefill"], servers["decode"], servers["bootstrap"]).run(client, body())
    assert p.status_code == 200, p.text
    check_answer(d, expected)


async def test_epd_applies_the_checkpoints_defaults(servers, expected):
    epd, image = servers["epd"], Image.random(*SIZE, seed=0)
    request = epd.body([image], TEXT, max_tokens=1)
    del request["temperature"], request["max_tokens"]
    async with httpx.AsyncClient(timeout=60) as client:
        await epd.claim([image], epd.encoders[0])
        encoded, (p, d) = await asyncio.gather(epd.encode(client, [image], epd.encoders[0], request["bootstrap_room"]),
                                               epd.chat(client, request))
    assert encoded.status_code == 200 and p.status_code == 200, (encoded.text, p.text)
    check_answer(d, expected)


def test_a_decode_with_other_defaults_is_refused_naming_the_flag(servers):
    """The prefill refuses the decode's KV request on their fingerprints, before the room's prompt is
    read, so the decode alone is asked."""
    room = Pair(servers["prefill"], servers["decode_none"], servers["bootstrap"]).room(body())
    d = httpx.post(f"{servers['decode_none'].url}/v1/chat/completions", json=room, timeout=60)
    assert (d.status_code, d.json()["error"]["code"]) == (502, "peer_failed"), d.text
    assert ('sampling defaults differ: prefill {"max_tokens":8,"repetition_penalty":1.5,"temperature":0.7,"top_k":1}, '
            "decode {}; start both with the same --generation-config") in d.json()["error"]["message"]


def test_server_info_lists_the_defaults(servers):
    infos = {name: httpx.get(f"{servers[name].url}/server_info", timeout=10).json()
             for name in ("colocated", "prefill", "decode", "decode_none")}
    infos["epd_prefill"] = servers["epd"].info(servers["epd"].prefill)
    for name, info in infos.items():
        want = ("none", {}) if name == "decode_none" else ("auto", DEFAULTS)
        assert (info["generation_config"], info["generation_defaults"]) == want, name
    assert infos["prefill"]["fingerprint"]["generation_defaults"] == json.dumps(DEFAULTS, sort_keys=True,
                                                                                separators=(",", ":"))
    assert infos["decode_none"]["fingerprint"]["generation_defaults"] == "{}"
