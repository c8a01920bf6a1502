"""One kind of image part per server (stages/api/chat.py's Preparer in its ImageMode): pixels on a
colocated or PD prefill, sizes from the header on a decode or EPD prefill, image references on an
EPD stage; a decode builds the same prompt without decoding a pixel; an image_ref checked by the
schema. In-process, over a generated tiny model's builders."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import ImageFile

from stages.api.chat import ImageMode, Preparer
from stages.api.errors import APIError
from stages.api.parse import parse_request
from stages.config import ImageLimits
from stages.engine.config import EngineConfig
from stages.loading import load_engine
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

KEY = "ab" * 32
LIMITS = ImageLimits(max_images=3, max_pixels=512 * 512)


@pytest.fixture(scope="module")
def builders():
    """The pixels builder (colocated, PD prefill) and the sizes-only builder (decode, EPD prefill)."""
    config = EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=4, device=DEVICE)
    full = load_engine(config, pixels=True)
    text = load_engine(EngineConfig(model=config.model, kv_cache_mib=4, parts=("text",), device=DEVICE), pixels=False)
    return full, text


def png_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    random_image(width, height, seed=1).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def body(*parts: dict) -> bytes:
    import json

    return json.dumps({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}],
                       "max_tokens": 4}).encode()


def image_url(width: int = 64, height: int = 48) -> dict:
    return {"type": "image_url", "image_url": {"url": png_url(width, height)}}


def image_ref(width: int = 64, height: int = 48) -> dict:
    return {"type": "image_ref", "image_ref": {"key": KEY, "width": width, "height": height}}


def preparer(loaded, mode: ImageMode) -> Preparer:
    engine, prompts = loaded
    return Preparer(prompts, engine, LIMITS, mode)


def test_a_decode_builds_the_same_prompt_without_decoding_a_pixel(builders, monkeypatch):
    full, text = builders
    expected, _ = preparer(full, ImageMode.PIXELS)(parse_request(body(image_url(), image_url(96, 40))))
    assert text[1].image_processor is None and text[0].adapter.parts == ("text",)

    def no_pixels(self):  # noqa: ANN001
        raise AssertionError("a decode decoded pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_pixels)
    from_header, _ = preparer(text, ImageMode.SIZES)(parse_request(body(image_url(), image_url(96, 40))))
    from_refs, _ = preparer(text, ImageMode.REFS)(parse_request(body(image_ref(), image_ref(96, 40))))
    assert from_header.token_ids == from_refs.token_ids == expected.token_ids
    assert from_header.image_tokens == expected.image_tokens and from_header.images == []


@pytest.mark.parametrize("mode, part, status, code, param", [
    (ImageMode.REFS, image_url(), 400, "image_url_not_supported", "messages[0].content[0]"),
    (ImageMode.SIZES, image_ref(), 400, "image_ref_not_supported", "messages[0].content[0]"),
    (ImageMode.PIXELS, image_ref(), 400, "image_ref_not_supported", "messages[0].content[0]"),
    (ImageMode.REFS, image_ref(1024, 1024), 413, "image_too_large", "messages[0].content[0].image_ref"),
], ids=["refs-refuse-url", "sizes-refuse-ref", "pixels-refuse-ref", "ref-over-max-pixels"])
def test_each_server_takes_one_kind_of_image_part(builders, mode, part, status, code, param):
    loaded = builders[0] if mode is ImageMode.PIXELS else builders[1]
    with pytest.raises(APIError) as refused:
        preparer(loaded, mode)(parse_request(body(part)))
    assert (refused.value.status, refused.value.code, refused.value.param) == (status, code, param)


@pytest.mark.unit
def test_an_image_ref_is_checked_by_the_schema():
    with pytest.raises(APIError) as refused:
        parse_request(body({"type": "image_ref", "image_ref": {"key": "XYZ", "width": 1, "height": 1}}))
    assert (refused.value.code, refused.value.param) == ("invalid_value", "messages[0].content[0].image_ref.key")
    with pytest.raises(APIError) as refused:
        parse_request(body({"type": "image_ref", "image_ref": {"key": KEY, "width": 0, "height": 1}}))
    assert refused.value.param == "messages[0].content[0].image_ref.width"
    with pytest.raises(APIError) as refused:
        parse_request(body({"type": "image_ref"}))
    assert "an image_ref part needs an 'image_ref' field" in refused.value.message
