"""How many requests a server holds at once. Pure logic; the chat route asks before reading a body."""

from __future__ import annotations


class Admission:
    """A counter with a cap. ``enter`` is the question and the commit in one (single event loop);
    every successful ``enter`` is paired with exactly one ``leave`` by whoever holds the request."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"admission limit must be > 0, got {limit}")
        self.limit = limit
        self.in_flight = 0

    def enter(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("Admission.leave without a matching enter")
        self.in_flight -= 1
