"""The engine's outputs of one chat request, as the ``n`` choices of its answer.

The engine yields the outputs of a request's ``n`` sequences interleaved, each with its ``index``
(``RequestOutput.index``). ``Choices`` groups them: for a whole answer it gathers each sequence's
text, logprobs and finish into a ``choice`` (``choices()``); for a stream it turns each output into
the chunk choices it stands for (``pieces()``), after a role chunk per index (``roles()``). Usage
counts the prompt once and the completion tokens of every sequence.

Logprobs (``logprobs=True``): each output's ``RequestOutput.logprobs`` (one per sampled token, the
end-of-sequence token included) go in the chunk of its text, or, where the detokenizer holds the
text back (a stop string may begin there), in a chunk whose delta is empty; the last output's in its
choice's finish chunk when it has no text.

Tools (``tools``, ``stages.api.tool_output``): each sequence's text goes through its own parser; a
whole answer's message gets ``tool_calls`` (``content`` null when there is no other text), a
stream's deltas are the parser's (content and tool-call pieces), and a sequence that ended by
itself (``stop``) having made calls finishes with ``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stages.api.chat_response import TokenText, choice, chunk_choice, logprobs_body, message
from stages.api.tool_output import ToolOutput, ToolStream
from stages.engine.outputs import RequestOutput
from stages.engine.logprobs import TokenLogprob
from stages.engine.request import FinishReason

ROLE_DELTA = {"role": "assistant", "content": ""}


@dataclass
class _Sequence:
    """One of the request's sequences: what its outputs said so far."""

    index: int
    stream: ToolStream | None  # its tool-call parser, streaming
    texts: list[str] = field(default_factory=list)  # whole answers only
    logprobs: list[TokenLogprob] = field(default_factory=list)  # whole answers only
    completion_tokens: int = 0
    finish: FinishReason | None = None


class Choices:
    """The choices of one request of ``n`` sequences. ``token_text``: with ``logprobs``, how a token
    id reads (``stages.api.token_text``); ``tools``: how text becomes tool calls, None where the
    request has no tools to call (or ``tool_choice`` none)."""

    def __init__(self, n: int, *, logprobs: bool, token_text: TokenText, tools: ToolOutput | None = None,
                 stream: bool = False) -> None:
        self.logprobs, self.token_text, self.tools = logprobs, token_text, tools
        self.sequences = [_Sequence(i, tools.stream() if tools is not None and stream else None) for i in range(n)]
        self.prompt_tokens = self.cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(sequence.finish is not None for sequence in self.sequences)

    @property
    def completion_tokens(self) -> int:
        return sum(sequence.completion_tokens for sequence in self.sequences)

    @property
    def longest(self) -> int:
        """The most completion tokens of one sequence."""
        return max(sequence.completion_tokens for sequence in self.sequences)

    def _take(self, output: RequestOutput) -> _Sequence:
        if not 0 <= output.index < len(self.sequences):
            raise ValueError(f"an output of sequence {output.index} of a request of {len(self.sequences)}")
        sequence = self.sequences[output.index]
        sequence.completion_tokens = output.completion_tokens
        sequence.finish = output.finish_reason
        self.prompt_tokens, self.cached_tokens = output.prompt_tokens, output.cached_tokens
        return sequence

    # --- a whole answer ------------------------------------------------------------------------
    def add(self, output: RequestOutput) -> None:
        sequence = self._take(output)
        sequence.texts.append(output.text)
        if self.logprobs and output.logprobs:
            sequence.logprobs.extend(output.logprobs)

    def choices(self) -> list[dict]:
        """The answer's choices, in index order (once every sequence has finished)."""
        return [self._choice(sequence) for sequence in self.sequences]

    def _choice(self, sequence: _Sequence) -> dict:
        assert sequence.finish is not None, "choices() before every sequence finished"
        text = "".join(sequence.texts)
        content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
        logprobs = logprobs_body(sequence.logprobs, self.token_text) if self.logprobs else None
        return choice(sequence.index, message(content, calls), _finish(sequence.finish, bool(calls)), logprobs)

    # --- a stream ------------------------------------------------------------------------------
    def roles(self) -> list[dict]:
        """The stream's first chunk choices: one role chunk per index."""
        return [chunk_choice(sequence.index, dict(ROLE_DELTA)) for sequence in self.sequences]

    def pieces(self, output: RequestOutput) -> list[dict]:
        """The chunk choices ``output`` stands for (one chunk each): its deltas, its sequence's finish
        chunk if it finished; its logprobs on the first of them, or alone with an empty delta."""
        sequence = self._take(output)
        if sequence.stream is not None:
            deltas = sequence.stream.feed(output.text) if output.text else []
            if output.finished:
                deltas += sequence.stream.finish()
        else:
            deltas = [{"content": output.text}] if output.text else []
        pieces = [chunk_choice(sequence.index, delta) for delta in deltas]
        if output.finish_reason is not None:
            called = sequence.stream is not None and sequence.stream.called
            pieces.append(chunk_choice(sequence.index, {}, _finish(output.finish_reason, called)))
        if self.logprobs and output.logprobs:
            logprobs = logprobs_body(output.logprobs, self.token_text)
            if pieces:
                pieces[0]["logprobs"] = logprobs
            else:
                pieces.append(chunk_choice(sequence.index, {}, logprobs=logprobs))
        return pieces


def _finish(reason: FinishReason, called: bool) -> str:
    """The choice's finish_reason: ``tool_calls`` for a sequence that stopped by itself after calls."""
    return "tool_calls" if called and reason is FinishReason.STOP else reason.value
