"""How a chat request's generated text becomes tool calls: the parsers ``stages.api.chat_choices``
runs over each sequence's text, chosen from the request's ``tools`` and ``tool_choice``."""

from __future__ import annotations

from typing import Protocol


class ToolStream(Protocol):
    """One sequence's streaming parser: text deltas in, OpenAI delta dicts out (``{"content": ...}``,
    ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}``)."""

    def feed(self, text: str) -> list[dict]: ...

    def finish(self) -> list[dict]:
        """What the parser still holds, once the sequence has ended."""
        ...

    @property
    def called(self) -> bool:
        """Whether it has emitted a tool call."""
        ...


class ToolOutput(Protocol):
    """A request's tool-call parsing."""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole sequence's text as (content, OpenAI ``tool_calls``); content None when only calls."""
        ...

    def stream(self) -> ToolStream:
        """A new streaming parser, for one sequence."""
        ...
