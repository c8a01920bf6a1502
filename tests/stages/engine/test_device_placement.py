"""Every tensor a step makes names its device: run steps with torch's default device set to ``meta``.

Under ``torch.device("meta")`` a factory call that names no device (``torch.tensor(ids)``,
``torch.arange(n)``, ...) makes a meta tensor, which has no data: mixing it with the engine's real
tensors raises, and reading it (``.tolist()``) raises, so the request fails with an error and its
tokens differ. Each test runs the same requests twice, normally and under ``meta``, and asks for the
same tokens and no error: prefills with images (the vision tower runs inside the step), batched
decodes, seeded sampling, logits processing and logprobs, and the decode side of a hand-off
(``add_prefilled`` replays a draw).
A negative control shows that a stray factory call is caught.
"""

from __future__ import annotations

import pytest
import torch

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.sampling_params import SamplingParams
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from stages.prompt import PromptBuilder
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

MAX_STEPS = 32
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# logits processing, logprobs and prompt logprobs make tensors of their own
PROCESSED = SamplingParams(max_tokens=6, temperature=0.7, seed=3, ignore_eos=True, logit_bias=((5, 2.0),),
                           repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logprobs=3,
                           prompt_logprobs=2)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "llava"])
def loaded(request) -> tuple[Engine, PromptBuilder]:
    return load_engine(EngineConfig(model=str(model_dir(request.param)), kv_cache_mib=16, device=DEVICE), pixels=True)


@pytest.fixture(scope="module")
def engine(loaded) -> Engine:
    return loaded[0]


def prompts(builder: PromptBuilder) -> list:
    image = [{"type": "image"}, {"type": "text", "text": "what is this?"}]
    text = [{"type": "text", "text": "say something long about the sea"}]
    return [builder.build([{"role": "user", "content": image}], [random_image(64, 48, seed=1)]),
            builder.build([{"role": "user", "content": text}], []),
            builder.build([{"role": "user", "content": image}], [random_image(48, 80, seed=2)]),
            builder.build([{"role": "user", "content": text}], [])]


def run(loaded: tuple[Engine, PromptBuilder], tag: str, default_device: str | None) -> dict[str, tuple[list[int], str | None]]:
    """Four requests added at once (two greedy, one seeded, one with bias, penalties, logprobs and
    prompt logprobs), stepped to the end with torch's default device set to ``default_device`` during
    admission and steps; (tokens, error) per request."""
    engine, builder = loaded
    results: dict[str, tuple[list[int], str | None]] = {}
    requests = prompts(builder)
    with torch.device(default_device) if default_device else torch.device(DEVICE):
        for i, (prompt, params) in enumerate(zip(requests, [GREEDY, SEEDED, GREEDY, PROCESSED])):
            engine.add_request(f"{tag}-{i}", prompt, params)
        for _ in range(MAX_STEPS):
            if not engine.has_work():
                break
            for output in engine.step():
                tokens, error = results.get(output.request_id, ([], None))
                results[output.request_id] = (tokens + output.token_ids, error or output.error)
    assert not engine.has_work() and engine.allocator.num_used == 0
    return {rid.split("-", 1)[1]: value for rid, value in results.items()}


def test_a_step_makes_every_tensor_on_the_engines_device(loaded):
    normal = run(loaded, "normal", None)
    assert all(error is None and len(tokens) == 6 for tokens, error in normal.values()), normal
    assert run(loaded, "meta", "meta") == normal


def test_the_decode_side_of_a_hand_off_names_its_devices(loaded):
    engine, builder = loaded
    prompt = prompts(builder)[0]
    handed = engine.add_request("handed", prompt, SEEDED, hand_off=True)
    while engine.has_work():
        engine.step()
    expected = engine.add_request("alone", prompts(builder)[0], SEEDED)
    while engine.has_work():
        engine.step()
    blocks = engine.reserve_blocks(prompt, SEEDED)  # as a decode server does, then the "transfer":
    engine.pool.tensor[blocks[: len(handed.blocks)]] = engine.pool.tensor[handed.blocks]
    engine.free_blocks(handed.blocks)
    with torch.device("meta"):
        (first,) = engine.add_prefilled(Prefilled("decoded", prompt, SEEDED, blocks, FirstTokens(handed.output_ids[:1]),
                                                    handed.rope_delta))
        tokens = list(first.token_ids)
        for _ in range(MAX_STEPS):
            if not engine.has_work():
                break
            for output in engine.step():
                assert output.error is None, output.error
                tokens += output.token_ids
    assert tokens == expected.output_ids  # the draw of the first token was replayed
    assert engine.allocator.num_used == 0


def test_a_stray_factory_call_is_caught(loaded, monkeypatch):
    """Negative control: a runner that makes its token ids without naming a device fails under meta."""
    engine = loaded[0]
    monkeypatch.setattr(engine.runner, "_tensor", lambda values: torch.tensor(values, dtype=torch.long))
    results = run(loaded, "stray", "meta")
    assert all(error is not None for _, error in results.values()), results
    assert engine.allocator.num_used == 0
