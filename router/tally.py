"""What the router saw of one streamed answer, for its metrics. Pure: the relay passes each event
with the time it arrived.

TPOT uses the stage's ``usage.completion_tokens`` when the client asked for usage; otherwise the
number of text chunks (one per token, except where the detokenizer held text back to check a stop
string).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.sse import Event, Kind


@dataclass
class Tally:
    started: float  # arrival at the router
    first_text: float | None = None
    last_text: float | None = None
    text_events: int = 0
    completion_tokens: int | None = None
    error: dict | None = None  # an in-band error event's body
    done: bool = False  # [DONE] seen

    def see(self, event: Event, now: float) -> None:
        if event.kind is Kind.TEXT:
            self.text_events += 1
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
        if self.first_text is None or self.last_text is None or tokens < 2:
            return None
        return (self.last_text - self.first_text) / (tokens - 1)
