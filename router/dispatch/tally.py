"""What the router saw of one streamed answer, for its metrics. Pure: the relay passes each event
with the time it arrived.

TPOT is per sequence: the time from the first output to the last over each choice's tokens less
one. Tokens: the stage's ``usage.completion_tokens`` (every choice's) when the client asked for
usage; otherwise one per choice per output chunk (a token each, except where the detokenizer held
text back to check a stop string). With ``n`` choices, each choice's share: the tokens over the
choices that carried output (``Event.outputs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.dispatch.sse import Event, Kind


@dataclass
class Tally:
    started: float  # arrival at the router
    first_text: float | None = None
    last_text: float | None = None
    text_events: int = 0  # choices' outputs seen: one per choice per TEXT event
    choices: set[int] = field(default_factory=set)  # the indices of the choices that carried output
    completion_tokens: int | None = None
    error: dict | None = None  # an in-band error event's body
    done: bool = False  # [DONE] seen

    def text(self, index: int, now: float) -> None:
        """A chunk whose one output is choice ``index``'s arrived at ``now`` (``see`` of a ``Kind.TEXT``
        event with ``outputs == (index,)``; ``router.dispatch.sse.text_choice``)."""
        self.text_events += 1
        self.choices.add(index)
        if self.first_text is None:
            self.first_text = now
        self.last_text = now

    def see(self, event: Event, now: float) -> None:
        if event.kind is Kind.TEXT:
            self.text_events += max(1, len(event.outputs))
            self.choices.update(event.outputs)
            self.first_text = self.first_text if self.first_text is not None else now
            self.last_text = now
        elif event.kind is Kind.USAGE and event.body is not None:
            tokens = (event.body.get("usage") or {}).get("completion_tokens")
            self.completion_tokens = tokens if isinstance(tokens, int) else None
        elif event.kind is Kind.ERROR:
            self.error = event.body
        elif event.kind is Kind.DONE:
            self.done = True

    @property
    def ttft(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.started

    @property
    def tpot(self) -> float | None:
        tokens = self.completion_tokens if self.completion_tokens is not None else self.text_events
        per_choice = tokens / max(1, len(self.choices))
        if self.first_text is None or self.last_text is None or per_choice < 2:
            return None
        return (self.last_text - self.first_text) / (per_choice - 1)
