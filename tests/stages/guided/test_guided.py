"""Structured output (``stages.guided``): random logits masked by a compiled schema's matcher and sampled
to the end always make JSON that validates; the mask never allows a token the tokenizer lacks and
allows end-of-sequence exactly when the grammar may end; schemas the compiler cannot take are
ValueErrors; every prompt builder ``stages.loading`` makes has its compiler; and the engine, sampling
a random-weight model under a guide, ends every sequence with valid JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from stages.engine.config import EngineConfig
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from stages.guided import GuideCompiler
from stages.loading import load_engine
from stages.prompt import text_decoding
from tests.support.generated_models import model_dir

SEEDS = range(20)
EXTRA_VOCAB = 37  # lm_head rows past the tokenizer's vocabulary
MAX_STEPS = 400
BOUNDED = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "where": {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
                  "additionalProperties": False},
    },
    "required": ["color", "name", "size", "where"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_dir("qwen2_vl"))


@pytest.fixture(scope="module")
def eos(tokenizer) -> frozenset[int]:
    ids = text_decoding(model_dir("qwen2_vl"), tokenizer).eos_token_ids
    assert len(ids) == 2  # the generated Qwen checkpoints end on <|im_end|> or <|endoftext|>
    return ids


@pytest.fixture(scope="module")
def compiler(tokenizer, eos) -> GuideCompiler:
    return GuideCompiler(tokenizer, len(tokenizer) + EXTRA_VOCAB, eos)


def sample(guide, tokenizer, eos, seed: int, bias: dict[int, float] | None = None) -> str:
    """Random logits (plus ``bias``), masked, sampled until end-of-sequence; checks every mask on the way."""
    generator = torch.Generator().manual_seed(seed)
    matcher, tokens = guide.matcher(), []
    vocab = len(tokenizer) + EXTRA_VOCAB
    for _ in range(MAX_STEPS):
        logits = torch.randn(vocab, generator=generator) * 3
        for token, value in (bias or {}).items():
            logits[token] += value
        matcher.mask(logits)
        allowed = set(torch.isfinite(logits).nonzero().view(-1).tolist())
        assert allowed and max(allowed) < len(tokenizer), "a token the tokenizer lacks is allowed"
        if matcher.done:
            assert allowed == set(eos), "a complete grammar allows end-of-sequence and nothing else"
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token in eos:
            matcher.accept(token)
            return tokenizer.decode(tokens)
        matcher.accept(token)
        tokens.append(token)
    raise AssertionError(f"no end within {MAX_STEPS} tokens: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("seed", SEEDS)
def test_a_bounded_schema_always_makes_valid_json(compiler, tokenizer, eos, seed):
    text = sample(compiler.compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "thing", "schema": BOUNDED, "strict": True}}), tokenizer, eos, seed)
    jsonschema.validate(json.loads(text), BOUNDED)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_makes_an_object(compiler, tokenizer, eos, seed):
    """Any object: random logits leaning to the closing characters (so strings and objects end soon)."""
    closers = {tokenizer.convert_tokens_to_ids(c): 6.0 for c in ('"', "}", "]")}
    text = sample(compiler.compile_response_format({"type": "json_object"}), tokenizer, eos, seed, closers)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("variant", ["llava", "llava_siglip_qwen2", "qwen3_vl"])
def test_every_generated_tokenizer_compiles_and_makes_valid_json(variant):
    """Each generated family's tokenizer (their special tokens and end-of-sequence ids differ: the
    Llama-style llava one ends on </s> alone)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir(variant))
    eos = text_decoding(model_dir(variant), tokenizer).eos_token_ids
    guide = GuideCompiler(tokenizer, len(tokenizer) + EXTRA_VOCAB, eos).compile_schema(BOUNDED)
    for seed in range(5):
        jsonschema.validate(json.loads(sample(guide, tokenizer, eos, seed)), BOUNDED)


def test_the_layout_is_compact_with_spaces_after_separators(compiler, tokenizer, eos):
    text = sample(compiler.compile_schema(BOUNDED), tokenizer, eos, 0)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)


def test_text_is_no_guide_and_other_formats_are_refused(compiler):
    assert compiler.compile_response_format({"type": "text"}) is None
    with pytest.raises(ValueError, match="response_format.type"):
        compiler.compile_response_format({"type": "regex"})
    with pytest.raises(ValueError, match="json_schema"):
        compiler.compile_response_format({"type": "json_schema"})


@pytest.mark.parametrize("schema, why", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"$ref": "http://example.com/schema.json"}, "http://example.com/schema.json"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"type": "nonsense"}, "nonsense"),
])
def test_a_schema_it_cannot_compile_is_a_value_error_naming_why(compiler, schema, why):
    with pytest.raises(ValueError, match="cannot be used to constrain output") as raised:
        compiler.compile_schema(schema)
    assert why in str(raised.value) and "\n" not in str(raised.value)


def test_a_schema_must_be_a_json_object(compiler):
    with pytest.raises(ValueError, match="must be an object"):
        compiler.compile_schema(["not", "a", "schema"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not JSON"):
        compiler.compile_schema({"const": float("nan")})


def test_compiled_grammars_are_cached_by_schema_text_in_key_order(compiler):
    first = compiler.compile_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    again = compiler.compile_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    swapped = compiler.compile_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}})
    assert again is first and swapped is not first


def test_a_forbidden_token_is_refused(compiler, tokenizer):
    matcher = compiler.compile_schema(BOUNDED).matcher()
    with pytest.raises(ValueError, match="breaks the grammar"):
        matcher.accept(tokenizer.convert_tokens_to_ids('"'))  # an object starts with {


def test_each_sequence_gets_its_own_matcher(compiler, tokenizer):
    guide = compiler.compile_schema({"enum": ["yes", "no"]})
    one, two = guide.matcher(), guide.matcher()
    one.accept(tokenizer.convert_tokens_to_ids('"'))
    logits = torch.zeros(len(tokenizer) + EXTRA_VOCAB)
    two.mask(logits)
    assert torch.isfinite(logits).nonzero().view(-1).tolist() == [tokenizer.convert_tokens_to_ids('"')]


def test_every_loaded_prompt_builder_has_a_compiler_for_its_engine():
    engine, builder = load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=4, parts=("text",)),
                                  pixels=False)
    assert builder.guides is not None and builder.guides.vocab_size == engine.vocab_size


def test_the_engine_samples_valid_json_under_a_guide():
    """A random-weight model, 20 seeded requests in one batch: each stops by itself with valid JSON."""
    engine, builder = load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16, parts=("text",)),
                                  pixels=False)
    prompt = builder.build_from_sizes([{"role": "user", "content": "Describe a thing as JSON."}], [])
    guide = builder.guides.compile_schema(BOUNDED)
    texts: dict[str, str] = {}
    finish: dict[str, FinishReason | None] = {}
    for seed in SEEDS:
        engine.add_request(f"r{seed}", prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=seed, guide=guide))
    for _ in range(400):
        if not engine.has_work():
            break
        for out in engine.step():
            assert out.error is None, out.error
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            finish[out.request_id] = out.finish_reason
    assert set(finish.values()) == {FinishReason.STOP}, finish
    for text in texts.values():
        jsonschema.validate(json.loads(text), BOUNDED)


UNSTATED = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}


@pytest.mark.parametrize("seed", range(5))
def test_an_object_that_does_not_state_additional_properties_ends_after_its_own(compiler, tokenizer, eos, seed):
    """Random logits leaning to ``"``, ``,`` and ``:`` (what an extra key is made of) still end with
    the declared key alone: the object is closed (``stages.guided.closed``)."""
    lean = {tokenizer.convert_tokens_to_ids(c): 6.0 for c in ('"', ",", ":")}
    assert json.loads(sample(compiler.compile_schema(UNSTATED), tokenizer, eos, seed, lean)).keys() == {"city"}


def test_an_object_open_as_written_stays_open(compiler, tokenizer):
    """``additionalProperties: true`` and ``{"type": "object"}`` allow a key after the first: a ","."""
    comma = tokenizer.convert_tokens_to_ids(",")
    for schema in ({**UNSTATED, "additionalProperties": True}, UNSTATED):
        matcher = compiler.compile_schema(schema).matcher()
        for token in tokenizer.encode('{"city": "Paris"'):
            matcher.accept(token)
        logits = torch.zeros(len(tokenizer) + EXTRA_VOCAB)
        matcher.mask(logits)
        assert bool(torch.isfinite(logits[comma])) is (schema is not UNSTATED)


def test_a_schema_that_needs_its_object_open_compiles_as_written(compiler, tokenizer, eos):
    """A required key the properties do not declare: closed, no object could have it; as written, it can."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["zz"]}
    lean = {tokenizer.convert_tokens_to_ids(c): 6.0 for c in ('"', "}")}
    assert "zz" in json.loads(sample(compiler.compile_schema(schema), tokenizer, eos, 0, lean))
