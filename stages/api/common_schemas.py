"""The answers every stage route shares, beside chat's own (``stages.api.chat_response``): the model
list, health, and the error body of every non-2xx answer and of an in-band stream error. Plain dicts
are built by the function at the end; the models describe them for ``/openapi.json`` and the tests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """A response model: the answer has exactly these fields (the unit tests build answers through them)."""

    model_config = ConfigDict(extra="forbid")


class ModelCard(StrictModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(StrictModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(StrictModel):
    status: Literal["ok"]


class ErrorDetail(StrictModel):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx).")
    param: str | None = Field(description="The request parameter at fault, as a path: messages[0].content[1].")
    code: str | None = Field(description="A stable machine-readable reason, e.g. context_length_exceeded, "
                             "request_too_large, server_overloaded.")
    # the typed fields (``stages.api.errors.TYPED_FIELDS``): present where known, absent otherwise
    stage: str | None = Field(None, description="The role that answers: colocated, prefill, decode or encoder.")
    room: int | None = Field(None, description="The bootstrap room the error is about.")
    image_key: str | None = Field(None, description="The content key of the image the error is about.")
    peer_code: str | None = Field(None, description="A decode reporting its prefill's failure (peer_failed): "
                                  "the prefill's own code for it.")


class ErrorBody(StrictModel):
    """Every non-2xx answer, and the in-band event that ends a stream whose request failed."""

    error: ErrorDetail


def model_card(model_id: str, created: int, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
