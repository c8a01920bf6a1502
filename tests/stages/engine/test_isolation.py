"""One request never fails another, in the engine itself (in-process, tiny model).

Poison requests (extreme sampling parameters, a sampler that raises, images that cannot be encoded or
encode to the wrong size, a forward pass that raises for one request after the layers before it
have written KV) share steps with eight normal greedy requests. Each normal request must produce
exactly the text it produces alone; each poison request fails alone, with an error naming its
cause. Admission is all-or-nothing: a check that raises half-way leaves no trace.
"""

from __future__ import annotations

import pytest

import stages.engine.engine as engine_module
import stages.engine.sampler as sampler_module
from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.outputs import RequestOutput
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from stages.prompt import PromptBuilder
from tests.support.devices import DEVICE, assert_same_or_near_tie, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_inputs, load_reference, random_image

MAX_STEPS = 64


@pytest.fixture(scope="module")
def loaded() -> tuple[Engine, PromptBuilder]:
    return load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=32, device=DEVICE), pixels=True)


@pytest.fixture(scope="module")
def engine(loaded) -> Engine:
    return loaded[0]


@pytest.fixture(scope="module")
def prompts(loaded) -> PromptBuilder:
    return loaded[1]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def build(prompts: PromptBuilder, i: int, with_image: bool):
    images = [random_image(32 + 16 * (i % 3), 48 + 16 * (i % 2), seed=300 + i)] if with_image else []
    parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": "tell me about " + "word " * (i + 1)}]
    return prompts.build([{"role": "user", "content": parts}], images)


def run(engine: Engine, arrivals: dict[int, list[tuple[str, object, SamplingParams]]]) -> dict[str, list[RequestOutput]]:
    """Add each request at its step number, step until all are done; every output of each request."""
    outputs: dict[str, list[RequestOutput]] = {}
    for step in range(MAX_STEPS):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
            outputs[request_id] = []
        if not engine.has_work() and step > max(arrivals):
            break
        for output in engine.step():
            outputs[output.request_id].append(output)
    assert not engine.has_work(), "the engine did not finish within the step bound"
    assert engine.allocator.num_used == 0 and engine._tracked == {}
    return outputs


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_poison_requests_fail_alone_and_the_batch_keeps_its_exact_text(engine, prompts, monkeypatch):
    normal = {f"normal-{i}": (build(prompts, i, with_image=i % 2 == 1), greedy(6 + i % 4)) for i in range(8)}
    alone = {rid: run(engine, {0: [(rid, prompt, params)]})[rid] for rid, (prompt, params) in normal.items()}
    narrow_prompt = build(prompts, 20, with_image=False)
    narrow_alone = run(engine, {0: [("narrow-alone", narrow_prompt, greedy(6))]})["narrow-alone"]

    bad_image, short_image = build(prompts, 30, with_image=True), build(prompts, 31, with_image=True)
    encode = engine.adapter.encode

    def faulty_encode(images):
        if any(image is bad_image.images[0] for image in images):
            raise RuntimeError("injected encode failure")
        embeddings = encode(images)
        return [type(e)(e.embeds[:-1], e.grid_thw, e.deepstack) if image is short_image.images[0] else e
                for image, e in zip(images, embeddings)]

    filter_logits = sampler_module.filter_logits

    def faulty_filter(logits, params):
        if params.seed == 666:
            raise RuntimeError("injected sampling fault")
        return filter_logits(logits, params)

    last_layer = len(engine.adapter.text_model.layers) - 1
    pack, layer_hook, in_step, failed_sizes = engine.runner._pack, engine.adapter.layer_hook, [], []

    def recording_pack(prefills, decodes):
        in_step[:] = [(r.request_id, len(r.output_ids)) for r in prefills + decodes]
        return pack(prefills, decodes)

    def faulty_layer_hook(index, hidden, image_rows, embeddings):
        # the poison fails in its third step, at the last layer: every earlier layer has written
        # the KV of every request in the step, which the retry must overwrite with the same values
        if index == last_layer and ("bad-forward", 2) in in_step:
            failed_sizes.append(len(in_step))
            raise RuntimeError("injected forward fault")
        return layer_hook(index, hidden, image_rows, embeddings)

    monkeypatch.setattr(engine.adapter, "encode", faulty_encode)
    monkeypatch.setattr(sampler_module, "filter_logits", faulty_filter)
    monkeypatch.setattr(engine.runner, "_pack", recording_pack)
    monkeypatch.setattr(engine.adapter, "layer_hook", faulty_layer_hook)
    items = list(normal.items())
    arrivals = {
        0: [(rid, prompt, params) for rid, (prompt, params) in items[:4]] + [
            ("cold", build(prompts, 40, with_image=False), SamplingParams(max_tokens=8, temperature=5e-324)),
            ("bad-image", bad_image, greedy(8)),
            ("short-image", short_image, greedy(8)),
            ("faulty-sampler", build(prompts, 41, with_image=False), SamplingParams(max_tokens=8, seed=666)),
        ],
        2: [(rid, prompt, params) for rid, (prompt, params) in items[4:]] + [
            ("narrow", narrow_prompt, SamplingParams(max_tokens=6, top_p=1e-320, ignore_eos=True)),
            ("bad-forward", build(prompts, 42, with_image=True), greedy(8)),
        ],
    }
    outputs = run(engine, arrivals)

    reference = load_reference(model_dir("qwen2_vl")) if on_gpu() else None
    for rid in normal:
        tokens, tokens_alone = ([t for o in runs[rid] for t in o.token_ids] for runs in (outputs, alone))
        if reference is not None:  # a GPU's batched kernels may part from batch-1 at a near tie (tests/support/devices.py)
            assert_same_or_near_tie(reference, hf_inputs(normal[rid][0], engine.adapter.image_token_id),
                                    tokens_alone, tokens)
        else:
            assert text(outputs[rid]) == text(alone[rid]), rid
            assert tokens == tokens_alone, rid
        assert outputs[rid][-1].finish_reason is FinishReason.LENGTH and outputs[rid][-1].error is None
    # top_p below float32's smallest number keeps the top token only (documented), not nothing
    assert outputs["narrow"][-1].error is None
    if reference is None:
        assert text(outputs["narrow"]) == text(narrow_alone)
    errors = {rid: [(o.finish_reason, o.error) for o in outputs[rid]] for rid in
              ("cold", "bad-image", "short-image", "faulty-sampler", "bad-forward")}
    abort = FinishReason.ABORT
    assert errors == {
        "cold": [(abort, "SamplingError: temperature=5e-324 scales the logits out of torch.float32 range; "
                         "use temperature 0 for greedy decoding")],
        "bad-image": [(abort, "image encoding failed: RuntimeError: injected encode failure")],
        "short-image": [(abort, f"image 0 was encoded to {short_image.images[0].num_tokens - 1} tokens but fills "
                                f"{short_image.images[0].num_tokens} placeholders")],
        "faulty-sampler": [(abort, "SamplingError: sampling failed with temperature=1.0, top_p=1.0, top_k=0: "
                                   "RuntimeError: injected sampling fault")],
        "bad-forward": [(None, None), (None, None), (abort, "RuntimeError: injected forward fault")],
    }
    assert max(failed_sizes) == 10 and failed_sizes[-1] == 1  # failed with 9 others, then again alone


@pytest.mark.unit
def test_seed_outside_what_torch_takes_is_refused_by_name():
    for seed in (2**64, 2**70, -(2**63) - 1):
        with pytest.raises(ValueError, match=rf"seed must be in \[-2\*\*63, 2\*\*64 - 1\], got {seed}"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def assert_no_trace(engine: Engine) -> None:
    assert not engine.has_work() and engine._tracked == {} and engine.allocator.num_used == 0


def test_admission_that_fails_half_way_leaves_no_trace(engine, prompts, monkeypatch):
    prompt = build(prompts, 1, with_image=False)

    def no_generator(seed, device):
        raise RuntimeError("injected generator failure")

    monkeypatch.setattr(engine_module, "make_generator", no_generator)
    with pytest.raises(RuntimeError, match="injected generator failure"):
        engine.add_request("half-way", prompt, greedy(4))
    assert_no_trace(engine)
    blocks = engine.reserve_blocks(prompt, greedy(4))
    with pytest.raises(RuntimeError, match="injected generator failure"):
        engine.add_prefilled(Prefilled("half-way", prompt, greedy(4), blocks, FirstTokens([7])))
    assert_no_trace(engine)  # the engine owned the blocks and gave them back
    monkeypatch.undo()
    assert text(run(engine, {0: [("half-way", prompt, greedy(4))]})["half-way"])  # the id is free again


def test_add_prefilled_refuses_what_it_cannot_decode_and_frees_the_blocks(engine, prompts):
    prompt, params = build(prompts, 2, with_image=False), greedy(4)
    cases = [
        ([-1], False, "first token -1 is not in this model's vocabulary"),
        ([engine.vocab_size], False, f"first token {engine.vocab_size} is not in this model's vocabulary"),
        ([7], True, "blocks given, the request needs"),
    ]
    for first_tokens, short, message in cases:
        blocks = engine.reserve_blocks(prompt, params)
        if short:
            engine.free_blocks(blocks[-1:])
            blocks = blocks[:-1]
        with pytest.raises(ValueError, match=message):
            engine.add_prefilled(Prefilled("refused", prompt, params, blocks, FirstTokens(first_tokens)))
        assert_no_trace(engine)


def test_a_duplicate_id_is_refused_and_the_first_request_goes_on(engine, prompts):
    prompt, params = build(prompts, 3, with_image=False), greedy(5)
    alone = text(run(engine, {0: [("dup", prompt, params)]})["dup"])
    first = engine.add_request("dup", prompt, params)
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request("dup", prompt, greedy(3))
    blocks = engine.reserve_blocks(prompt, params)
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_prefilled(Prefilled("dup", prompt, params, blocks, FirstTokens([7])))
    outputs = [o for _ in range(MAX_STEPS) if engine.has_work() for o in engine.step()]
    assert "".join(o.text for o in outputs) == alone and first.finish_reason is FinishReason.LENGTH
    assert_no_trace(engine)


def test_reserve_blocks_that_can_never_fit_allocates_nothing(engine, prompts):
    prompt = build(prompts, 4, with_image=False)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.reserve_blocks(prompt, greedy(engine.max_model_len))
    assert_no_trace(engine)
