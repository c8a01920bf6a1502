"""Compile ``response_format`` and JSON schemas into ``Guide``s (llguidance).

JSON comes out in one layout: no free whitespace, ``", "`` between items and ``": "`` between a
key and its value (what ``json.dumps`` and the chat templates' ``tojson`` write), so a random-weight
model cannot spend its tokens on blank space and a real one sees the spacing it was trained on.
An object schema that declares properties and leaves ``additionalProperties`` unstated is closed
(``stages.guided.closed``), as llama.cpp and xgrammar's strict mode do: llguidance alone would
leave it open, and a random-weight model writes extra keys without end. Compiled grammars are
kept in an LRU keyed by the schema's JSON text (key order kept: it is the order properties are
generated in). Compiling can take milliseconds on a large schema: call it off
the event loop, as the request preparer does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from stages.guided.closed import closed_objects
from stages.guided.matcher import LlgGuide

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_ERROR_CHARS = 400  # of llguidance's message, in ours
CACHE_SIZE = 128  # compiled grammars kept
# What every schema compiles with (llguidance's "overrides": a schema's own "x-guidance" cannot change them)
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GuideCompiler:
    """Grammars over one model's tokens. ``tokenizer``: the checkpoint's (a fast Hugging Face
    tokenizer); ``vocab_size``: the model's lm_head width (may exceed the tokenizer's: the extra
    tokens are never allowed); ``eos_token_ids``: the ids that end a sequence (the engine's; default
    the tokenizer's EOS), allowed exactly when the grammar is complete."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int] | None = None) -> None:
        eos = sorted(eos_token_ids) if eos_token_ids is not None else tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile_text)

    def compile_response_format(self, response_format: dict) -> LlgGuide | None:
        """An OpenAI ``response_format``: ``{"type": "text"}`` -> None (no constraint);
        ``{"type": "json_object"}`` -> any JSON object; ``{"type": "json_schema", "json_schema":
        {"name", "schema", "strict"}}`` -> that schema (any JSON object when it has none; the schema
        binds whether ``strict`` is set or not). ValueError for any other shape or a schema that
        cannot be compiled, its message fit for the client."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.compile_schema(ANY_OBJECT)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema'")
            schema = spec.get("schema")
            return self.compile_schema(ANY_OBJECT if schema is None else schema)
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")

    def compile_schema(self, schema: dict) -> LlgGuide:
        """A grammar every output of which is JSON valid against ``schema``, its objects closed after
        their declared properties where the schema does not say (``stages.guided.closed``); if the
        closed schema cannot be compiled (a required key only the open object allowed), the schema as
        written. ValueError naming what cannot be compiled (an unsupported keyword, a remote $ref, an
        unsatisfiable schema...)."""
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        text = _json_text(schema)
        closed = _json_text(closed_objects(schema))
        try:
            return self._compile(closed)
        except ValueError:
            if closed == text:
                raise
        return self._compile(text)

    def _compile_text(self, schema_text: str) -> LlgGuide:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_OPTIONS)
        start = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if start.is_error():
            raise ValueError(f"the JSON schema cannot be used to constrain output: {_one_line(start.get_error())}")
        return LlgGuide(start, self.vocab_size)


def _json_text(schema: dict) -> str:
    """The schema's compact JSON text (key order kept): the cache's key. ValueError if it is not JSON."""
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None


def _one_line(text: str) -> str:
    """llguidance's compile error on one line, cut to ``MAX_ERROR_CHARS``."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."
