"""Tools (``stages.api.tools``, the generated templates' Qwen tool format, ``PromptBuilder`` with tools):
a tool loop renders exactly as Qwen2.5's template writes it; a template without a tool format is
refused; ``<tool_call>`` blocks parse into OpenAI tool calls, whole or streamed in any chunking (the
two agree); forced tool choices give the vLLM schemas, and random logits constrained by them come
back as calls naming the function."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from stages.api import tools as t
from stages.engine.config import EngineConfig
from stages.guided import GuideCompiler
from stages.loading import load_engine
from stages.prompt import ToolsNotSupported, text_decoding
from tests.support.generated_models import model_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": None,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
                                       "required": ["zone"], "additionalProperties": False,
                                       "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}


@pytest.fixture(scope="module")
def builders():
    def builder(variant):
        return load_engine(EngineConfig(model=str(model_dir(variant)), kv_cache_mib=4, parts=("text",)), pixels=False)[1]
    return {variant: builder(variant) for variant in ("qwen2_5_vl", "llava")}


# --- the prompt --------------------------------------------------------------------------------------

TOOL_LOOP = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], '
    '"additionalProperties": false}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
    "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsnow\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nSunny in Paris, snow in Oslo.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def tool_loop_messages() -> list[dict]:
    """A tool loop in the OpenAI shape, converted as the chat route converts it."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    return [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": t.template_tool_calls(calls)},
        {"role": "tool", "content": t.tool_content("sunny"), "tool_call_id": "call_1"},
        {"role": "tool", "content": t.tool_content([{"type": "text", "text": "sn"}, {"type": "text", "text": "ow"}]),
         "tool_call_id": "call_2"},
        {"role": "assistant", "content": "Sunny in Paris, snow in Oslo."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_a_tool_loop_renders_in_qwen_format(builders):
    builder = builders["qwen2_5_vl"]
    rendered = builder.render(tool_loop_messages(), t.template_tools([WEATHER]))
    assert rendered == TOOL_LOOP
    prompt = builder.build_from_sizes(tool_loop_messages(), [], tools=t.template_tools([WEATHER]))
    assert prompt.token_ids == builder.tokenizer(TOOL_LOOP, add_special_tokens=False)["input_ids"]


def test_the_system_message_leads_the_tools_block_and_no_tools_renders_as_before(builders):
    builder = builders["qwen2_5_vl"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with_tools = builder.render(messages, t.template_tools([WEATHER]))
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert with_tools.count("<|im_start|>system") == 1
    assert builder.render(messages) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                                       "<|im_start|>assistant\n"


def test_a_template_without_a_tool_format_refuses_tools(builders):
    assert builders["qwen2_5_vl"].supports_tools and not builders["llava"].supports_tools
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ToolsNotSupported, match="no tool format"):
        builders["llava"].build_from_sizes(messages, [], tools=t.template_tools([WEATHER]))
    assert builders["llava"].build_from_sizes(messages, [], tools=[]).token_ids  # no tools: as ever


@pytest.mark.unit
def test_tool_call_arguments_must_be_a_json_object():
    with pytest.raises(ValueError, match=r"tool_calls\[0\].function.arguments is not JSON"):
        t.template_tool_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}])
    with pytest.raises(ValueError, match="must be a JSON object"):
        t.template_tool_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}])


# --- the output --------------------------------------------------------------------------------------

def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


OUTPUTS = [  # (text, content, [(name, arguments)])
    ("Hello there.", "Hello there.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n', "Let me check.", [("a", {"x": 1}), ("b", {})]),
    ('<tool_call>\n{"name": "a", "arguments": {"s": "</tool"}}\n</tool_call> then text', "then text",
     [("a", {"s": "</tool"})]),
    ('<tool_call>\n{"name": "a", "arguments": {"y": [1, 2]}}\n', None, [("a", {"y": [1, 2]})]),  # EOS before the close
    ('<tool_call>\n{"name": "a", "argu', '<tool_call>\n{"name": "a", "argu', []),  # cut by max_tokens
    ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ('A <tool_call>{"arguments": {}}</tool_call>\n<tool_call>{"name": "f"}</tool_call> B',
     'A <tool_call>{"arguments": {}}</tool_call>B', [("f", {})]),
    ("a < b and <tool but no call", "a < b and <tool but no call", []),
    ("trailing space \n", "trailing space \n", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>', None, [("f", {"k": 2})]),
]


@pytest.mark.unit
@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_tool_calls_parse_out_of_the_text(text, content, calls):
    got_content, got_calls = t.parse_tool_calls(text)
    assert got_content == content and names_and_arguments(got_calls) == calls


def stream(text: str, cuts: list[int]) -> tuple[str | None, list[dict]]:
    """``text`` fed in pieces cut at ``cuts``; the deltas put back together (content, calls)."""
    parser, deltas, at = t.ToolCallStream(), [], 0
    for cut in [*cuts, len(text)]:
        deltas += parser.feed(text[at:cut])
        at = cut
    deltas += parser.finish()
    content, calls = "", []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}) and (delta.get("content") or delta.get("tool_calls"))
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            assert call["index"] == len(calls)
            calls.append({key: value for key, value in call.items() if key != "index"})
    assert parser.called == bool(calls)
    return content or None, calls


@pytest.mark.unit
@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_a_stream_in_any_chunking_gives_what_the_whole_text_parses_to(text, content, calls):
    rng = random.Random(text)
    chunkings = [[], list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1)))
                                                   for k in (1, 3, 7) for _ in range(5)]
    for cuts in chunkings:
        got_content, got_calls = stream(text, cuts)
        assert got_content == content and names_and_arguments(got_calls) == calls, cuts


@pytest.mark.unit
def test_a_stream_never_shows_tag_text_and_holds_back_only_what_may_be_a_tag():
    parser = t.ToolCallStream()
    assert parser.feed("Sure") == [{"content": "Sure"}]
    assert parser.feed(". <tool") == [{"content": "."}]  # " <tool" may open a call
    assert parser.feed('_call>{"name": "f", "arguments": {}}</tool_') == []
    (delta,) = parser.feed("call>")
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert parser.feed("\n") == [] and parser.finish() == []


# --- tool_choice required or a named function ---------------------------------------------------------

@pytest.mark.unit
def test_forced_schemas_are_vllms():
    assert t.forced_tool_schema([WEATHER], "auto") is None and t.forced_tool_schema([WEATHER], None) is None
    assert t.forced_tool_schema([WEATHER], "none") is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert t.forced_tool_schema([WEATHER, TIME], named) == WEATHER["function"]["parameters"]
    assert t.forced_tool_schema([{"type": "function", "function": {"name": "f"}}], {"function": {"name": "f"}}) == \
        {"type": "object", "properties": {}}
    required = t.forced_tool_schema([WEATHER, TIME], "required")
    assert required["type"] == "array" and required["minItems"] == 1
    assert required["$defs"] == {"zone": {"enum": ["UTC", "CET"]}}
    first, second = required["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert "$defs" not in second["properties"]["parameters"] and first["required"] == ["name", "parameters"]
    with pytest.raises(ValueError, match="not among the tools"):
        t.forced_tool_schema([WEATHER], {"type": "function", "function": {"name": "nope"}})


@pytest.mark.unit
def test_forced_output_becomes_tool_calls():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert names_and_arguments(t.forced_tool_calls('{"city": "Oslo"}', named)) == [("get_weather", {"city": "Oslo"})]
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert names_and_arguments(t.forced_tool_calls(text, "required")) == [("get_time", {"zone": "UTC"}),
                                                                          ("get_weather", {"city": "Oslo"})]
    assert t.ForcedToolOutput("required").parse(text)[0] is None


CUT = [  # a required output cut by max_tokens -> its calls (name, arguments text), as OpenAI answers
    ("", []),
    ("[", []),
    ('[{"name": "get_ti', []),  # the name is not whole yet
    ('[{"name": "get_time"', [("get_time", "")]),
    ('[{"name": "get_time", "param', [("get_time", "")]),
    ('[{"name": "get_time", "parameters": ', [("get_time", "")]),
    ('[{"name": "get_time", "parameters": {"zone": "U', [("get_time", '{"zone": "U')]),
    ('[{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", '{"zone": "UTC"}')]),
    ('[{"name": "get_time", "parameters": {"zone": "UTC"}}, ', [("get_time", '{"zone": "UTC"}')]),
    ('[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"ci',
     [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"ci')]),
    ('[{"name": "get_time", "parameters": {"zone": "UTC"}}]', [("get_time", '{"zone": "UTC"}')]),
    ('[ {"name":"get_time","parameters":{"zone":"UTC"}} ,{"name" : "a\\"b"', [("get_time", '{"zone": "UTC"}'),
                                                                        ('a"b', "")]),  # any spacing; an escape
    ('{"name": "get_time"}', []),  # not an array
]


@pytest.mark.unit
@pytest.mark.parametrize("text, calls", CUT)
def test_a_required_output_cut_by_max_tokens_is_still_its_calls_never_content(text, calls):
    def named(found: list[dict]) -> list[tuple[str, str]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in found]
    assert named(t.forced_tool_calls(text, "required")) == calls
    content, parsed = t.ForcedToolOutput("required").parse(text)
    assert content is None and named(parsed) == calls
    stream = t.ForcedToolStream("required")
    assert stream.feed(text) == []
    deltas = stream.finish()
    streamed = [call for delta in deltas for call in delta["tool_calls"]]
    assert all(set(delta) == {"tool_calls"} for delta in deltas) and stream.called is bool(calls)
    assert [c["index"] for c in streamed] == list(range(len(calls))) and named(streamed) == calls


@pytest.mark.unit
def test_a_named_call_cut_by_max_tokens_holds_the_text_so_far():
    named = {"type": "function", "function": {"name": "get_weather"}}
    (call,) = t.ForcedToolOutput(named).parse('{"city": "Os')[1]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Os'}
    assert t.ForcedToolOutput(named).parse('{"city": "Os')[0] is None


@pytest.mark.unit
def test_a_forced_named_call_streams_its_arguments():
    parser = t.ForcedToolStream({"type": "function", "function": {"name": "get_weather"}})
    first, = parser.feed('{"city"')
    call = first["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city"'} and parser.called
    assert parser.feed(': "Oslo"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}]
    assert parser.finish() == []
    required = t.ForcedToolStream("required")
    assert required.feed('[{"name": "get_time", ') == [] and required.feed('"parameters": {"zone": "CET"}}]') == []
    (delta,) = required.finish()
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_time"] and required.called


@pytest.mark.unit
def test_a_parser_is_chosen_from_the_tool_choice():
    assert t.tool_output(None, "auto") is None and t.tool_output([WEATHER], "none") is None
    assert isinstance(t.tool_output([WEATHER], None), t.TaggedToolOutput)
    assert isinstance(t.tool_output([WEATHER], "required"), t.ForcedToolOutput)
    assert isinstance(t.tool_output([WEATHER], {"type": "function", "function": {"name": "get_weather"}}),
                      t.ForcedToolOutput)
    with pytest.raises(TypeError, match="tool_choice must be"):
        t.tool_output([WEATHER], object())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_random_logits_forced_to_call_come_back_as_calls_naming_the_function(choice):
    tokenizer = AutoTokenizer.from_pretrained(model_dir("qwen2_vl"))
    eos = text_decoding(model_dir("qwen2_vl"), tokenizer).eos_token_ids
    guide = GuideCompiler(tokenizer, len(tokenizer), eos).compile_schema(t.forced_tool_schema([WEATHER, TIME], choice))
    closers = {tokenizer.convert_tokens_to_ids("]"): 4.0}  # "required": end the array soon
    for seed in range(10):
        generator, matcher, tokens = torch.Generator().manual_seed(seed), guide.matcher(), []
        while True:
            logits = torch.randn(len(tokenizer), generator=generator) * 3
            for token, value in closers.items():
                logits[token] += value
            matcher.mask(logits)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            matcher.accept(token)
            if token in eos:
                break
            tokens.append(token)
        calls = names_and_arguments(t.forced_tool_calls(tokenizer.decode(tokens), choice))
        assert calls and all(name in ("get_time", "get_weather") for name, _ in calls)
        assert all(args in ({"zone": "UTC"}, {"zone": "CET"}) if name == "get_time" else args["city"] in ("Paris", "Oslo")
                   for name, args in calls)
        if choice != "required":
            assert [name for name, _ in calls] == ["get_time"]
