"""Placeholder counts from (width, height) alone agree with the image processor on real pixels, for
every family and many sizes; prompts built from sizes equal prompts built from images."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from tests.support.generated_models import VARIANTS, model_dir

# tiny, ordinary, odd, huge, and aspect ratios up to the Qwen processor's limit of 200:1
SIZES = [(1, 1), (2, 3), (7, 13), (28, 28), (29, 27), (56, 56), (64, 64), (97, 131), (224, 224), (333, 111),
         (640, 480), (480, 640), (1000, 5), (5, 1000), (1999, 10), (10, 1999), (1280, 720), (3000, 4000)]
REFUSED = [(2010, 10), (10, 2010)]  # aspect ratio over 200: the Qwen processor refuses these


def solid(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (200, 40, 90))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def builder(request) -> PromptBuilder:
    path = model_dir(request.param)
    return PromptBuilder.load(path, load_adapter(path, torch.float32, "sdpa", parts=("text",)))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_count_and_grid_from_size_match_the_processor(builder, size):
    processed = builder.preprocess(solid(*size))
    assert builder.num_image_tokens(*size) == processed.num_tokens
    assert builder.image_grid(*size) == processed.grid_thw  # None for LLaVA; (1, h, w) patches for Qwen


def test_a_sizes_only_builder_holds_no_image_processor(builder):
    sizes_only = PromptBuilder.load(builder.adapter.config._name_or_path, builder.adapter, pixels=False)
    assert sizes_only.image_processor is None
    assert sizes_only.num_image_tokens(97, 131) == builder.num_image_tokens(97, 131)
    with pytest.raises(RuntimeError, match="loaded without an image processor"):
        sizes_only.preprocess(solid(8, 8))


@pytest.mark.parametrize("size", REFUSED, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sizes_the_processor_refuses_are_refused_without_pixels(builder, size):
    try:
        expected = builder.preprocess(solid(*size)).num_tokens
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            builder.num_image_tokens(*size)
    else:  # LLaVA resizes and crops any aspect ratio
        assert builder.num_image_tokens(*size) == expected


@pytest.mark.parametrize("size", [(0, 5), (5, 0), (-1, 3)])
def test_empty_sizes_are_refused(builder, size):
    with pytest.raises(ValueError, match=r"at least 1x1 pixels"):
        builder.num_image_tokens(*size)


@pytest.mark.parametrize("sizes", [[], [(64, 64)], [(5, 1000), (97, 131), (1280, 720)]], ids=["0", "1", "3"])
def test_build_from_sizes_gives_the_same_ids_as_build(builder, sizes):
    parts = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": "What do these show?"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    from_images = builder.build(messages, [solid(w, h) for w, h in sizes])
    from_sizes = builder.build_from_sizes(messages, sizes)
    assert from_sizes.token_ids == from_images.token_ids
    assert from_sizes.images == [] and from_sizes.embeddings is None
    assert from_sizes.token_ids.count(builder.adapter.image_token_id) == sum(im.num_tokens for im in from_images.images)


def test_build_from_sizes_checks_the_image_count(builder):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(ValueError, match="the chat template wrote 1 image placeholders for 2 images"):
        builder.build_from_sizes(messages, [(8, 8), (9, 9)])
