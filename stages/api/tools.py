"""OpenAI tool calling over Qwen's tool format (pure: dicts in the OpenAI shape in and out).

In the prompt (rendered by the model's chat template, ``PromptBuilder.build(..., tools=...)``):
``template_tools`` gives the template the request's tools, ``template_tool_calls`` an assistant
message's calls (arguments as objects, as templates write them) and ``tool_content`` a tool
message's text.

In the output, the model calls a tool by writing ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``. ``parse_tool_calls`` splits a whole text into content and OpenAI
``tool_calls``; ``ToolCallStream`` does the same for a stream of text deltas, turning them into
OpenAI delta dicts. Both agree: content is the text outside the calls' blocks, without the
whitespace next to a call; a block whose JSON is not a call (no name, bad JSON) stays in the content
as written.

``tool_choice`` "required" or a named function is enforced by constrained generation, vLLM's way:
``forced_tool_schema`` is the JSON schema the output must follow (the function's parameters, or an
array of ``{"name", "parameters"}``), and ``forced_tool_calls`` / ``ForcedToolStream`` turn such
output into tool calls. A forced output cut by max_tokens is still tool calls, as OpenAI answers
(finish_reason ``length``, the last call's arguments unfinished JSON): a named function's call holds
the text so far; ``required`` gives every whole call and the cut one once its name is whole (never
the text as content). ``tool_output(tools, tool_choice)`` picks a request's parser (whole and
streaming: ``stages.api.tool_output.ToolOutput``). ``tool_choice`` is given as a string, a dict or None.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_SPACE = " \t\n\r"
# the start of a required call cut by max_tokens: its whole name, then its parameters' text if they began
CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"parameters"\s*:\s*(?P<arguments>.*))?', re.S)


def call_id() -> str:
    """A fresh tool call id, ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call (``arguments``: JSON text) with a fresh id."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# --- the prompt --------------------------------------------------------------------------------------

def template_tools(tools: list[dict]) -> list[dict]:
    """OpenAI ``tools`` as chat templates take them: ``{"type": "function", "function": {"name",
    "description", "parameters"}}``, keys that are None (unset) left out."""
    out = []
    for tool in tools:
        function = {key: value for key, value in tool["function"].items() if value is not None}
        out.append({"type": "function", "function": function})
    return out


def template_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` as templates take them: arguments as the object
    their JSON text holds. ValueError if a call's arguments are not a JSON object."""
    out = []
    for i, call in enumerate(tool_calls):
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"]) if isinstance(function["arguments"], str) \
                else function["arguments"]
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool_calls[{i}].function.arguments is not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON object")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def tool_content(content: str | list[dict] | None) -> str:
    """A tool message's content as text: a string as is, text parts joined, None as ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content)


# --- the output --------------------------------------------------------------------------------------

def _call_of(body: str) -> dict | None:
    """The tool call a block's JSON text is, or None: an object with a string ``name`` and object
    (or JSON text) ``arguments`` (absent: ``{}``)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        return tool_call(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """``text`` -> (content, tool calls). Content is the text outside the calls' ``<tool_call>``
    blocks, less the whitespace next to a call, None when nothing is left; a block the text ends in
    without ``</tool_call>`` is a call if its JSON is whole. Blocks that are not calls stay in the
    content as written."""
    pieces: list[str | dict] = []  # text, or a call
    at = 0
    while (start := text.find(OPEN, at)) >= 0:
        pieces.append(text[at:start])
        end = text.find(CLOSE, start + len(OPEN))
        stop = len(text) if end < 0 else end + len(CLOSE)
        call = _call_of(text[start + len(OPEN):len(text) if end < 0 else end])
        pieces.append(text[start:stop] if call is None else call)
        at = stop
    pieces.append(text[at:])
    calls = [piece for piece in pieces if isinstance(piece, dict)]
    content = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            if i + 1 < len(pieces) and isinstance(pieces[i + 1], dict):
                piece = piece.rstrip()
            if i > 0 and isinstance(pieces[i - 1], dict):
                piece = piece.lstrip()
            content.append(piece)
    return "".join(content) or None, calls


class ToolCallStream:
    """Text deltas of one choice in, OpenAI delta dicts out: ``{"content": text}`` and, once a block
    closes, ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
    "arguments"}}]}`` (the whole call in one delta; ``index`` counts the choice's calls from 0).
    Tag text is never shown as content: text that may begin a tag, and whitespace that may precede
    one, is held back until it is known. The content shown adds up to ``parse_tool_calls``'s. Call
    ``finish`` after the last delta."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet shown: a whitespace run and/or a possible tag's start
        self._block: str | None = None  # inside a block: its text so far
        self._gap = ""  # the whitespace before the open block (shown only if it is not a call)
        self._after_call = False  # drop the whitespace right after a call
        self.calls = 0  # made so far

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, delta: str) -> list[dict]:
        out: list[dict] = []
        text = self._pending + delta
        self._pending = ""
        while text:
            if self._block is not None:
                end = text.find(CLOSE)
                if end < 0:
                    keep = _partial_tag(text, CLOSE)
                    self._block += text[:len(text) - keep]
                    self._pending = text[len(text) - keep:]
                    return out
                self._close_block(self._block + text[:end], CLOSE, out)
                text = text[end + len(CLOSE):]
                continue
            if self._after_call:
                text = text.lstrip()
                if not text:
                    return out
                self._after_call = False
            start = text.find(OPEN)
            if start >= 0:
                shown = text[:start].rstrip()
                self._content(shown, out)
                self._gap, self._block = text[len(shown):start], ""
                text = text[start + len(OPEN):]
                continue
            keep = _partial_tag(text, OPEN)
            head = text[:len(text) - keep]
            shown = head.rstrip()
            self._content(shown, out)
            self._pending = text[len(shown):]
            return out
        return out

    def finish(self) -> list[dict]:
        """What is still held back: an unclosed block (a call if its JSON is whole, else its text as
        content), or held text as content."""
        out: list[dict] = []
        if self._block is not None:
            self._close_block(self._block + self._pending, "", out)
        else:
            self._content(self._pending, out)
        self._pending = ""
        return out

    def _close_block(self, body: str, close: str, out: list[dict]) -> None:
        self._block = None
        call = _call_of(body)
        if call is None:
            self._content(self._gap + OPEN + body + close, out)
        else:
            out.append({"tool_calls": [{"index": self.calls, **call}]})
            self.calls += 1
            self._after_call = True
        self._gap = ""

    @staticmethod
    def _content(text: str, out: list[dict]) -> None:
        if text:
            out.append({"content": text})


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


# --- tool_choice "required" or a named function -------------------------------------------------------

def forced_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names (``{"type": "function", "function": {"name": ...}}``), or None
    for a string or None. TypeError for anything else (a model object: pass its dict)."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    raise TypeError(f"tool_choice must be a string, a dict or None, not {type(tool_choice).__name__}")


def forced_tool_schema(tools: list[dict], tool_choice: Any) -> dict | None:
    """The JSON schema the whole output must follow to enforce ``tool_choice`` (vLLM's way), or None
    (``auto``, ``none``, unset): a named function -> its parameters' schema (a function without
    parameters: an object without properties, which compiles closed: ``{}``); ``required`` -> an array, at least one item, of ``{"name": one of the
    tools, "parameters": its schema}`` (each tool's ``$defs`` lifted to the top, where their
    ``$ref``s point). ValueError if the named function is not among ``tools`` or ``$defs`` clash."""
    name = forced_function(tool_choice)
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return _parameters(functions[name])
    if tool_choice != "required":
        return None
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one tool")
    defs: dict[str, Any] = {}
    items = []
    for function_name, function in functions.items():
        parameters = dict(_parameters(function))
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"the tools' parameters define $defs[{key!r}] differently: rename one")
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function_name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def forced_tool_calls(output_text: str, tool_choice: Any) -> list[dict]:
    """The tool calls an output constrained by ``forced_tool_schema`` makes: a named function -> one
    call with the output as its arguments; ``required`` -> one call per array item (arguments: the
    item's parameters as JSON text). Cut by max_tokens: a named function's call with the text so
    far; ``required``'s whole items and the cut one once its name is whole (arguments: its
    parameters' text so far, '' before they begin)."""
    name = forced_function(tool_choice)
    if name is not None:
        return [tool_call(name, output_text)]
    return required_calls(output_text)


def required_calls(text: str) -> list[dict]:
    """The calls of an output of ``required``'s schema, ``[{"name": ..., "parameters": {...}}, ...]``,
    whole or cut (see ``forced_tool_calls``); [] for text that does not begin so."""
    decoder = json.JSONDecoder()
    calls: list[dict] = []
    text = text.lstrip(JSON_SPACE)
    if not text.startswith("["):
        return []
    at = _skip(text, 1, JSON_SPACE)
    while at < len(text) and text[at] != "]":
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            cut = _cut_call(text[at:])
            return calls + ([cut] if cut is not None else [])
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(tool_call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
        at = _skip(text, at, JSON_SPACE + ",")
    return calls


def _skip(text: str, at: int, chars: str) -> int:
    """The first index from ``at`` whose character is not one of ``chars`` (``len(text)`` if none)."""
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _cut_call(item: str) -> dict | None:
    """An array item cut by max_tokens, ``{"name": "f", "parameters": {"a``: the call to ``f`` with
    the parameters' text so far as its arguments ('' before they begin); None before the name is whole."""
    match = CUT_CALL.match(item)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except json.JSONDecodeError:  # a bad escape: not a name the grammar allows
        return None
    return tool_call(name, match.group("arguments") or "")


class ForcedToolStream:
    """Text deltas of an output constrained by ``forced_tool_schema`` in, OpenAI delta dicts out. A
    named function: its call's id and name in the first delta, then each piece of text as arguments
    (as OpenAI streams them). ``required``: the calls once the output has ended (``finish``), whole
    or cut by max_tokens (``forced_tool_calls``); never content."""

    def __init__(self, tool_choice: Any) -> None:
        self._tool_choice = tool_choice
        self._name = forced_function(tool_choice)
        self._text = ""
        self._started = False  # a named function's call has been opened
        self.called = False

    def feed(self, delta: str) -> list[dict]:
        if self._name is None:
            self._text += delta
            return []
        if not delta:
            return []
        if not self._started:
            self._started = self.called = True
            return [{"tool_calls": [{"index": 0, **tool_call(self._name, delta)}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}]

    def finish(self) -> list[dict]:
        if self._name is not None:
            if self._started:
                return []
            self._started = self.called = True
            return [{"tool_calls": [{"index": 0, **tool_call(self._name, "")}]}]
        calls = forced_tool_calls(self._text, self._tool_choice)
        self.called = bool(calls)
        return [{"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}] if calls else []


# --- a request's choice of parser ------------------------------------------------------------------------

class TaggedToolOutput:
    """Tool calls the model writes itself (tool_choice auto), in ``<tool_call>`` blocks."""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        return parse_tool_calls(text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream()


class ForcedToolOutput:
    """Tool calls forced by ``tool_choice`` (required or a named function): the output is the calls'
    JSON (``forced_tool_schema``), never content (None): cut before a call's name, no calls either."""

    def __init__(self, tool_choice: Any) -> None:
        self.tool_choice = tool_choice

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        return None, forced_tool_calls(text, self.tool_choice)

    def stream(self) -> ForcedToolStream:
        return ForcedToolStream(self.tool_choice)


def tool_output(tools: list[dict] | None, tool_choice: Any) -> TaggedToolOutput | ForcedToolOutput | None:
    """How a request's output turns into tool calls: None without tools or with tool_choice none;
    forced for required or a named function; else (auto, unset) the model's own ``<tool_call>`` blocks."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice == "required" or forced_function(tool_choice) is not None:
        return ForcedToolOutput(tool_choice)
    return TaggedToolOutput()
