"""The OpenAI chat-completions wire schema.

The request model is validated by pydantic (after ``parse``'s bounded first pass); unknown fields
are ignored. Every limit and clamp is stated in its field's description, so it shows in
``/openapi.json``. The chat answer's and stream chunks' bodies and their models are in
``stages.api.chat_response``; the other answers' models (models list, health, errors) in
``stages.api.common_schemas``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from contract.bootstrap import ROOM_MAX
from stages.api.message_schemas import ChatMessage
from stages.api.schema_types import (GEN, FUNCTION_NAME, MAX_HOST_CHARS, MAX_LOGIT_BIAS_TOKENS, MAX_MESSAGES,
                                     MAX_METADATA,
                                     MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_NAME_CHARS, MAX_SCHEMA_BYTES,
                                     MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOOLS, MIN_REPETITION_PENALTY,
                                     MIN_TEMPERATURE, MIN_TOP_P, SEED_MAX, SEED_MIN, AsInteger, Bias, MetadataKey,
                                     MetadataValue, Penalty, RequestModel, StopString, TokenCount, TokenId)
from stages.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="Send a last chunk with usage and no choices.")


class StopAndStreamFields:
    """What chat and completion requests read the same way of their ``stop`` and ``stream_options``
    fields (a mixin of both request models; its annotations are for the type checker only, so that
    pydantic takes the fields, their order and their schema from the models themselves)."""

    if TYPE_CHECKING:
        stop: str | list[str] | None
        stream_options: StreamOptions | None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ and -, at most 64 characters.")
    description: str | None = Field(None, description="What the function does, shown to the model.")
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON Schema (an object). A call "
                                              "forced by tool_choice follows it exactly (constrained decoding), "
                                              "an object that declares properties and leaves additionalProperties "
                                              "unsaid closed after them (as llama.cpp and xgrammar's strict mode); a "
                                              "schema the grammar compiler cannot take gets 400 invalid_tool_schema. "
                                              f"The request's schemas together: at most {MAX_SCHEMA_BYTES} bytes "
                                              "of JSON.")
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")


class Tool(RequestModel):
    type: Literal["function"] = Field(description="Function tools only (400 for any other type).")
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(max_length=MAX_NAME_CHARS, description="One of the tools' function names.")


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME, description="The format's name: a-z, A-Z, 0-9, _ and -, at most 64 "
                      "characters.")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON Schema the answer follows "
                                           "(constrained decoding); an object that declares properties and leaves "
                                           "additionalProperties unsaid is closed after them. None: any JSON "
                                           "object. A schema the grammar "
                                           "compiler cannot take gets 400 invalid_response_format. The request's "
                                           f"schemas together: at most {MAX_SCHEMA_BYTES} bytes of JSON.")
    strict: bool | None = Field(None, description="Accepted; the answer always follows the schema.")


class ResponseFormat(RequestModel):
    """``{"type": "text"}`` (the default), ``{"type": "json_object"}`` (any JSON object) or ``{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}}``: the answer is generated under a grammar
    that admits only that, so it parses (unless max_tokens cuts it: finish_reason length)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [  # the model validator below, for /openapi.json
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"properties": {"type": {"const": "json_schema"}, "json_schema": {"not": {"type": "null"}}},
         "required": ["json_schema"]}]})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, description="Required when type is json_schema.")

    @model_validator(mode="after")
    def _schema_for_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs a 'json_schema' field")
        return self


def _unsupported(what: str) -> Any:
    """A field OpenAI defines that would change the answer and this server does not implement: only
    null is accepted; any other value gets 400 ``unsupported_parameter`` (``stages.api.parse``)."""
    return Field(None, description=f"Not supported ({what}): any value but null gets 400 unsupported_parameter.")


def _forces_tool(choice: str | NamedToolChoice | None) -> bool:
    return choice == "required" or isinstance(choice, NamedToolChoice)


class ChatCompletionRequest(StopAndStreamFields, RequestModel):
    """An OpenAI chat completion request. Unknown fields are ignored. Fields OpenAI defines that change
    nothing here (user, safety_identifier, prompt_cache_key, metadata, store, service_tier,
    parallel_tool_calls) are accepted and ignored. Those that would change the answer and are not
    implemented (audio, modalities other than ["text"], prediction, web_search_options, functions,
    function_call, reasoning_effort, verbosity) get 400 unsupported_parameter naming the field, unless null."""

    model_config = ConfigDict(json_schema_extra={"allOf": [  # the field validators below, for /openapi.json
        {"anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                   {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]},
        {"anyOf": [{"properties": {"tool_choice": {"not": {"const": "required"}}}},
                   {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}]},
        {"anyOf": [{"properties": {"response_format": {"anyOf": [{"type": "null"},
                                                                  {"properties": {"type": {"const": "text"}}}]}}},
                   {"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}}]}]})
    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_MESSAGES,
        description=f"The conversation: 1 to {MAX_MESSAGES} messages. A prompt longer than the model's context "
        "(the server's --max-model-len) gets 400 context_length_exceeded.")
    model: str | None = Field(None, max_length=256, description="If given, the served model's id (GET /v1/models); "
                              "any other gets 404 model_not_found.")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, allow_inf_nan=False,
        description=f"In [0, 2]; 0 is greedy decoding. Default: the checkpoint's ({GEN}), else 1. A value "
        f"between 0 and {MIN_TEMPERATURE} is raised "
        f"to {MIN_TEMPERATURE} (smaller ones would scale the logits out of float range). NaN and infinities get 400.")
    top_p: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False,
        description=f"Nucleus sampling, in [0, 1]. Default: the checkpoint's ({GEN}), else 1. A value below "
        f"{MIN_TOP_P} (0 included, as OpenAI "
        f"takes it) is raised to {MIN_TOP_P}: either keeps only the most likely token. NaN gets 400.")
    top_k: Annotated[int, Field(ge=-1), AsInteger] | None = Field(
        None, description="Extension: sample among the k most likely tokens. 0 or -1 disables it, and so "
        f"does a k at or above the vocabulary size (it would keep every token). Default: the checkpoint's ({GEN}), "
        "else disabled.")
    max_tokens: TokenCount | None = Field(
        None, description="Tokens to generate at most, per choice. The prompt plus this must fit the model's "
        "context (--max-model-len), else 400 context_length_exceeded. Default: what is left of the context, or the "
        f"checkpoint's max_new_tokens if fewer ({GEN}).")
    max_completion_tokens: TokenCount | None = Field(None, description="As max_tokens, which it overrides.")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters "
        "each. Generation stops before the first one found, which is not returned.")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), AsInteger] | None = Field(
        None, description="A signed 64-bit integer seeding this request's own sampler: a seeded request draws "
        "the same tokens whatever shares its batch. Choice i of n draws from seed + i (as vLLM).")
    n: Annotated[int, Field(ge=1, le=MAX_N), AsInteger] | None = Field(
        1, description=f"Choices to generate, 1 to {MAX_N}, from one prompt computed once; usage counts the "
        "tokens of all of them. Greedy choices are all the same.")
    presence_penalty: Penalty | None = Field(
        None, description="In [-2, 2], default 0: subtracted from the logit of every token the choice has "
        "generated so far, once (vLLM's semantics; applied to greedy decoding too).")
    frequency_penalty: Penalty | None = Field(
        None, description="In [-2, 2], default 0: subtracted from a token's logit once per time the choice has "
        "generated it so far.")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=2.0, allow_inf_nan=False,
        description=f"Extension (vLLM's), in (0, 2], default the checkpoint's ({GEN}), else 1: the logit of every "
        "token in the prompt or the "
        f"output so far is divided by it if positive, multiplied by it if negative. A value below "
        f"{MIN_REPETITION_PENALTY} is raised to {MIN_REPETITION_PENALTY} (smaller ones would scale the logits out "
        "of float range).")
    logit_bias: Annotated[dict[TokenId, Bias], Field(max_length=MAX_LOGIT_BIAS_TOKENS, json_schema_extra={
        "additionalProperties": False})] | None = Field(
        None, description=f"At most {MAX_LOGIT_BIAS_TOKENS} token ids (as strings) mapped to a bias in "
        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to the token's logit before sampling (before the "
        "penalties). An id outside the model's vocabulary gets 400 naming logit_bias.")
    logprobs: bool | None = Field(
        False, description="Return each generated token's log-probability (and with top_logprobs the most "
        "likely alternatives) in choices[].logprobs.content: from the model's raw logits, before temperature, "
        "penalties, bias or any constraint (vLLM's raw logprobs).")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), AsInteger] | None = Field(
        None, description=f"0 to {MAX_LOGPROBS}: the most likely tokens to report at each position. Needs "
        "logprobs true (400 otherwise, as OpenAI).")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description=f"At most {MAX_TOOLS} function tools, offered to the model through its own chat template "
        "(a model whose template has no tool format gets 400 tools_not_supported). Tool calls the model writes "
        "come back as tool_calls with finish_reason tool_calls. An empty list is no tools.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (the default with tools): the model may call a tool; none: the tools are not "
        "offered to the model at all (its prompt is the one without tools, so it cannot write a call); "
        "required: at least one call, a named function: exactly that one, both enforced by constrained decoding; "
        "cut by max_tokens, the answer is still tool_calls (finish_reason length, the last call's arguments "
        "unfinished JSON; required's cut call once its name is whole), never content. "
        "required or a named function without tools, or naming a function not in tools, gets 400.")
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: the answer is generated under a grammar that admits only "
        "that (constrained decoding). Cannot be combined with a forced tool call (tool_choice required or a "
        "named function: 400).")
    stream: bool | None = Field(False, description="Answer as server-sent events (text/event-stream): "
                                "chat.completion.chunk objects, then `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="Extension, for benchmarks: generate past end-of-sequence "
                                    "tokens until max_tokens or a stop string.")
    # fields OpenAI defines that change nothing here
    user: str | None = Field(None, description="Accepted and ignored (no effect on the answer).")
    safety_identifier: str | None = Field(None, description="Accepted and ignored (no effect on the answer).")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored: prefix caching needs no key.")
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = Field(
        None, description=f"Accepted and ignored (no effect on the answer; nothing is stored): at most "
        f"{MAX_METADATA} pairs, keys up to {MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}.")
    mm_processor_kwargs: Annotated[dict[str, int | float], Field(max_length=MAX_METADATA)] | None = Field(
        None, description="Extension (vLLM's): this request's video sampling, within the server's bounds: fps, "
        "num_frames, min_frames, max_frames, min_pixels, max_pixels (the model's video processor's settings; "
        "/server_info video says the server's). Another key, or a value past the server's bounds: 400 "
        "invalid_value naming it.")
    store: bool | None = Field(None, description="Accepted and ignored: nothing is stored.")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="Accepted and ignored: every request is served alike.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored: the model may write several "
                                             "tool calls whatever it says.")
    # fields OpenAI defines that would change the answer, not implemented: null or 400 unsupported_parameter
    audio: None = _unsupported("audio output")
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = Field(
        None, description='Only ["text"] (or null); any other value gets 400 unsupported_parameter.')
    prediction: None = _unsupported("predicted outputs")
    web_search_options: None = _unsupported("web search")
    functions: None = _unsupported("deprecated; use tools")
    function_call: None = _unsupported("deprecated; use tool_choice")
    reasoning_effort: None = _unsupported("not a reasoning model")
    verbosity: None = _unsupported("no verbosity control")
    # prefill/decode disaggregation: the fields SGLang's PD router injects (one room for both stages)
    bootstrap_host: str | None = Field(
        None, max_length=MAX_HOST_CHARS,
        description="Prefill and decode servers (required there, with bootstrap_port and "
        "bootstrap_room; 400 without): the prefill's bootstrap address, the same in both halves of a request. "
        "A decode dials only prefills its --allowed-bootstrap allows (403 otherwise). Colocated servers ignore it.")
    bootstrap_port: Annotated[int, Field(ge=1, le=65535), AsInteger] | None = Field(
        None, description="The prefill's bootstrap port.")
    bootstrap_room: Annotated[int, Field(ge=0, le=ROOM_MAX), AsInteger] | None = Field(
        None, description="The room pairing the prefill half and the decode half of one request; unique among "
        "requests in flight.")

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top_logprobs

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: str | NamedToolChoice | None,
                            info: ValidationInfo) -> str | NamedToolChoice | None:
        if "tools" not in info.data:  # the tools failed validation: that error is reported
            return choice
        names = [tool.function.name for tool in info.data["tools"] or ()]
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function '{choice.function.name}', which is not among the tools")
        return choice

    @field_validator("response_format")
    @classmethod
    def _not_with_a_forced_tool(cls, response_format: ResponseFormat | None,
                                info: ValidationInfo) -> ResponseFormat | None:
        choice = info.data.get("tool_choice")
        if response_format is not None and response_format.type != "text" and _forces_tool(choice):
            raise ValueError("response_format cannot be combined with a forced tool call (tool_choice required "
                             "or a named function)")
        return response_format

    @property
    def forces_tool(self) -> bool:
        """tool_choice makes the model call a tool (required or a named function)."""
        return _forces_tool(self.tool_choice)

    @property
    def tool_choice_json(self) -> str | dict | None:
        """``tool_choice`` as its JSON value (a string, or the named function's dict), as
        ``stages.api.tools`` takes it."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model, as OpenAI tool dicts; None for no tools or
        tool_choice none (the model is not told of tools it may not call)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]
