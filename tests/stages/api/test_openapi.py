"""The stage's OpenAPI document (stages/api/openapi.py) documents image references: the ImageRef
schema, the image_ref content part, and the error codes an EPD stage answers. No model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


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
