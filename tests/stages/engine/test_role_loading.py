"""Each role loads only its half of the model: the encoder the vision tower and projector, prefill and
decode the language model and head. The halves hold exactly the full model's tensors, and a
text-only engine (fed embeddings from a vision-only adapter) still matches HF generate()."""

from __future__ import annotations

import pytest
import torch

from stages.engine.config import EngineConfig
from stages.engine.models import load_adapter
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from stages.prompt import PromptBuilder
from tests.support.generated_models import VARIANTS, model_dir
from tests.support.hf_reference import hf_greedy, load_reference, random_image

STEPS = 10


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    path = model_dir(request.param)
    full = load_adapter(path, torch.float32, "sdpa")
    return path, full, load_adapter(path, torch.float32, "sdpa", parts=("vision",))


def by_half(adapter_cls, named) -> dict[str, dict[str, torch.Tensor]]:
    """The full model's tensors split by the adapter's module paths (every one belongs to a half)."""
    halves: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "text": {}}
    for name, tensor in named:
        owners = [part for part in halves
                  if any(name.startswith(path + ".") for path in adapter_cls.modules_of((part,)))]
        assert len(owners) == 1, f"{name} belongs to {owners}"
        halves[owners[0]][name] = tensor
    return halves


def test_each_role_holds_exactly_its_half(variant):
    path, full, vision = variant
    text = load_adapter(path, torch.float32, "sdpa", parts=("text",))
    params = by_half(type(full), full.model.named_parameters())
    assert full.num_parameters == sum(p.numel() for half in params.values() for p in half.values())
    assert vision.num_parameters == sum(p.numel() for p in params["vision"].values()) > 0
    assert text.num_parameters == sum(p.numel() for p in params["text"].values()) > 0
    for adapter, half in ((vision, "vision"), (text, "text")):
        state = dict(adapter.model.named_parameters()) | dict(adapter.model.named_buffers())
        expected = by_half(type(full), [*full.model.named_parameters(), *full.model.named_buffers()])[half]
        assert sorted(state) == sorted(expected)
        assert all(torch.equal(state[name], expected[name]) for name in state)  # incl. rotary inv_freq
        assert not any(t.is_meta for t in state.values())
    assert text.parts == ("text",) and vision.parts == ("vision",) and full.parts == ("vision", "text")


def test_vision_half_encodes_exactly_like_the_full_model(variant):
    path, full, vision = variant
    builder = PromptBuilder.load(path, vision)
    images = [builder.preprocess(random_image(w, h, seed=i)) for i, (w, h) in enumerate([(64, 64), (96, 40)])]
    for ours, theirs in zip(vision.encode(images), full.encode(images), strict=True):
        assert torch.equal(ours.embeds, theirs.embeds)
        assert ours.grid_thw == theirs.grid_thw
        assert (ours.deepstack is None) == (theirs.deepstack is None)
        if ours.deepstack is not None:
            assert torch.equal(ours.deepstack, theirs.deepstack)


def test_text_half_refuses_to_encode(variant):
    path = variant[0]
    text = load_adapter(path, torch.float32, "sdpa", parts=("text",))
    with pytest.raises(RuntimeError, match=r"loaded without its vision half \(parts=\('text',\)\)"):
        text.encode([])


def test_unknown_parts_are_refused():
    with pytest.raises(ValueError, match="parts must be a non-empty subset"):
        load_adapter(model_dir("qwen2_vl"), torch.float32, "sdpa", parts=("audio",))
    with pytest.raises(ValueError, match="parts must be a non-empty subset"):
        EngineConfig(model="unused", parts=())


@pytest.mark.parametrize("num_images", [0, 2])
def test_text_only_engine_matches_generate(variant, num_images):
    """Prefill/decode role: a text-only engine; images (if any) encoded by the vision-only adapter."""
    path, _, vision = variant
    engine, prompts = load_engine(EngineConfig(model=str(path), kv_cache_mib=16, parts=("text",)), pixels=False)
    assert engine.adapter.num_parameters < load_reference(path).num_parameters()
    assert prompts.image_processor is None  # a text-only stage builds prompts from sizes, never from pixels
    images = [random_image(64 + 32 * i, 48, seed=10 + i) for i in range(num_images)]
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": "Hello there, what is this?"}]
    reference_prompt = PromptBuilder.load(path, vision).build([{"role": "user", "content": parts}], images)
    expected = hf_greedy(load_reference(path), reference_prompt, engine.adapter.image_token_id, STEPS)

    prompt = prompts.build_from_sizes([{"role": "user", "content": parts}], [im.size for im in images])
    prompt.embeddings = vision.encode(reference_prompt.images)
    request = engine.add_request("r", prompt, SamplingParams(max_tokens=STEPS, temperature=0.0))
    for _ in range(STEPS + 2):
        if not engine.has_work():
            break
        engine.step()
    assert request.output_ids == expected
    assert engine.allocator.num_used == 0
