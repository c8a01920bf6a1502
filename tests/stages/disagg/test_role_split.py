"""In-process checks of the role split and the EPD edge: a decode builds prompts without decoding a
pixel or holding an image processor, each server takes one kind of image part, a cached entry is
used only if it fits its reference (pure ``check_embedding``), and colocated's ``/server_info``."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import ImageFile

from cache.entry import Entry, InRedis
from cache.store import CachedEmbedding
from stages.api.chat import ImageMode, Preparer
from stages.api.errors import APIError
from stages.api.parse import parse_request
from stages.config import ImageLimits, ServerConfig
from stages.disagg.embeddings import EmbeddingShape, Expected, Mismatch, check_embedding
from stages.engine.config import EngineConfig
from stages.engine.models import load_adapter
from stages.loading import load_engine
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

KEY = "ab" * 32
LIMITS = ImageLimits(max_images=3, max_pixels=512 * 512)


# --- check_embedding (pure) ------------------------------------------------------------------------
def hit(num_tokens: int = 4, grid: list[int] | None = None, **tensors: torch.Tensor) -> CachedEmbedding:
    tensors = tensors or {"embeds": torch.ones(num_tokens, 8)}
    entry = Entry(KEY, [], num_tokens, [1, 4, 4] if grid is None else grid, 0, "enc", 0.0, 0.0, InRedis())
    return CachedEmbedding(entry, tensors)


QWEN = EmbeddingShape(hidden_size=8, deepstack_layers=0)
EXPECTED = Expected(num_tokens=4, grid=(1, 4, 4))


def test_an_entry_that_fits_becomes_the_embedding():
    embedding = check_embedding(hit(), EXPECTED, QWEN)
    assert embedding.num_tokens == 4 and embedding.grid_thw == (1, 4, 4) and embedding.deepstack is None
    deep = check_embedding(hit(embeds=torch.ones(4, 8), deepstack=torch.ones(2, 4, 8)), EXPECTED,
                           EmbeddingShape(8, 2))
    assert deep.deepstack.shape == (2, 4, 8)
    assert check_embedding(hit(grid=[]), Expected(4, None), QWEN).grid_thw is None  # LLaVA: no grid


@pytest.mark.parametrize("cached, expected, shape, reason", [
    (hit(num_tokens=5, embeds=torch.ones(5, 8)), EXPECTED, QWEN, "the entry has 5 tokens, the reference's size fills 4"),
    (hit(grid=[1, 2, 8]), EXPECTED, QWEN, "the entry's image grid is [1, 2, 8], the reference's size gives [1, 4, 4]"),
    (hit(embeds=torch.ones(4, 16)), EXPECTED, QWEN, "tensor 'embeds' has shape [4, 16], this model needs [4, 8]"),
    (hit(embeds=torch.ones(3, 8)), EXPECTED, QWEN, "tensor 'embeds' has shape [3, 8], this model needs [4, 8]"),
    (hit(), EXPECTED, EmbeddingShape(8, 2), "the entry holds tensors ['embeds'], this model needs ['deepstack', 'embeds']"),
    (hit(embeds=torch.ones(4, 8), deepstack=torch.ones(2, 4, 8)), EXPECTED, QWEN,
     "the entry holds tensors ['deepstack', 'embeds'], this model needs ['embeds']"),
    (hit(embeds=torch.ones(4, 8), deepstack=torch.ones(3, 4, 8)), EXPECTED, EmbeddingShape(8, 2),
     "tensor 'deepstack' has shape [3, 4, 8], this model needs [2, 4, 8]"),
    (hit(embeds=torch.ones(4, 8, dtype=torch.int32)), EXPECTED, QWEN,
     "tensor 'embeds' has dtype torch.int32, not a floating-point type"),
], ids=["tokens", "grid", "hidden", "rows", "no-deepstack", "extra-deepstack", "deepstack-layers", "dtype"])
def test_an_entry_that_does_not_fit_is_refused_by_name(cached, expected, shape, reason):
    with pytest.raises(Mismatch) as refused:
        check_embedding(cached, expected, shape)
    assert str(refused.value) == reason


# --- one kind of image part per server; a decode touches no pixel ----------------------------------
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


def test_colocated_server_info_reports_the_whole_model_and_its_memory():
    from stages.colocated import build

    path = str(model_dir("qwen2_vl"))
    app = build(ServerConfig(role="colocated", engine=EngineConfig(model=path, kv_cache_mib=4, device=DEVICE)))
    with TestClient(app) as client:
        info = client.get("/server_info").json()
    assert (info["role"], info["parts"], info["images"]) == ("colocated", ["vision", "text"], "pixels")
    assert info["num_parameters"] == load_adapter(path, torch.float32, "sdpa").num_parameters
    assert info["rss_bytes"] > 0


def test_openapi_documents_image_refs():
    from tests.support.stage_api import FakeAsyncEngine, client_for

    document = client_for(FakeAsyncEngine()).get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert schemas["ImageRef"]["required"] == ["key", "width", "height"]
    assert schemas["ImageRef"]["properties"]["key"]["pattern"] == "^[0-9a-f]{64}$"
    assert {"properties": {"type": {"const": "image_ref"}, "image_ref": {"not": {"type": "null"}}},
            "required": ["image_ref"]} in schemas["ContentPart"]["anyOf"]
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "image_not_cached" in responses["400"]["description"]
    assert "cache_unavailable" in responses["503"]["description"]
