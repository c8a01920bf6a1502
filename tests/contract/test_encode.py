"""The encoder's bodies (``contract.encode``): what the router sends decodes as the contract's request,
and the encoder's own models (its checks, its /openapi.json) have the contract's fields."""

from __future__ import annotations

import msgspec
import pytest

from contract.encode import (IMAGE_STATUSES, AbortAnswer, AbortRequest, EncodeAnswer, EncodedImage, EncodeImage,
                             EncodeRequest)
from stages.encoder import openapi as encoder_openapi
from stages.encoder import routes as encoder_routes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("struct, model", [
    (EncodeRequest, encoder_routes.EncodeRequest), (EncodeImage, encoder_routes.ImagePart),
    (AbortRequest, encoder_routes.AbortRequest), (EncodeAnswer, encoder_openapi.EncodeAnswer),
    (EncodedImage, encoder_openapi.EncodedImage), (AbortAnswer, encoder_openapi.AbortAnswer),
])
def test_the_encoders_models_have_the_contracts_fields(struct, model):
    assert set(struct.__struct_fields__) == set(model.model_fields)


def test_an_image_status_is_one_of_three():
    assert IMAGE_STATUSES == ("encoded", "cached", "pending_elsewhere")
    schema = encoder_openapi.EncodedImage.model_json_schema()["properties"]["status"]
    assert set(schema["enum"]) == set(IMAGE_STATUSES)


def test_a_request_is_the_room_and_each_image_once_without_unset_fields():
    raw = msgspec.json.encode(EncodeRequest(7, [EncodeImage(key="ab", url="data:image/png;base64,AA==")]))
    assert raw == b'{"room":7,"images":[{"key":"ab","url":"data:image/png;base64,AA=="}]}'
    assert encoder_routes.EncodeRequest.model_validate_json(raw).room == 7
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"room":7,"images":[],"extra":1}', type=EncodeRequest)
