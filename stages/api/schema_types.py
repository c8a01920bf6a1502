"""The building blocks of the request schemas: every bound a field states (so it shows in
``/openapi.json``), the annotated field types, and ``RequestModel`` (strict JSON types, unknown fields
ignored). Imported by the chat and completion request models (``stages.api.schemas``,
``stages.api.message_schemas``, ``stages.api.completion_schema``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from stages.engine.sampling_params import MAX_LOGIT_BIAS

MAX_MESSAGES = 2048  # as OpenAI's API
MAX_CONTENT_PARTS = 64  # per message
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # per stop string: the detokenizer holds back that many characters of a stream
MIN_TEMPERATURE = 0.01  # a sampled temperature below this is raised to it (smaller ones overflow the logits)
MIN_TOP_P = 1e-6  # a top_p below this is raised to it (both keep only the most likely token)
# where a sampling field a request leaves out takes its default from (stages.generation_defaults)
GEN = "its generation_config.json, unless the server runs --generation-config none"
MIN_REPETITION_PENALTY = 0.01  # a repetition_penalty below this is raised to it (smaller ones overflow the logits)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_HOST_CHARS = 255  # a DNS name's limit
MAX_IMAGE_SIDE = 2**31 - 1  # an image_ref's width or height (its pixel count is bounded by --max-image-pixels)
MAX_TOOLS = 128  # as OpenAI's API
MAX_TOOL_CALLS = 128  # per assistant message
MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI's API
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # as OpenAI's API
MAX_SCHEMA_BYTES = 1 << 20  # the JSON of a request's schemas together (tools' parameters, response_format's)
MAX_NAME_CHARS = 64  # a function's or a response format's name, as OpenAI's API
MAX_ID_CHARS = 256  # a tool call's id
FUNCTION_NAME = rf"^[a-zA-Z0-9_-]{{1,{MAX_NAME_CHARS}}}$"
# fields OpenAI defines that would change the answer and this server does not implement: a value other
# than null (modalities: other than ["text"]) gets 400 unsupported_parameter (``stages.api.parse``)
UNSUPPORTED = ("audio", "modalities", "prediction", "web_search_options", "functions", "function_call",
               "reasoning_effort", "verbosity")


StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


def _integral(value: object) -> object:
    """JSON Schema's integers include 721.0; strict validation then takes it as 721, and still refuses
    ``true``, ``"721"`` and 721.5."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


AsInteger = BeforeValidator(_integral)  # after the bounds in Annotated, so that they show in the JSON schema
TokenCount = Annotated[int, Field(ge=1), AsInteger]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
TokenId = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")]  # no sign, no leading zero
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
MetadataKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)]


class RequestModel(BaseModel):
    """Unknown fields are ignored; known ones take exactly their JSON type (``true`` is not 1, ``"0.5"``
    is not 0.5), as the JSON schema in /openapi.json says."""

    model_config = ConfigDict(extra="ignore", strict=True)
