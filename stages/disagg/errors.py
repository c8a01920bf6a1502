"""Errors of a disaggregated request, each with the HTTP status the stage server answers."""

from __future__ import annotations


class DisaggError(RuntimeError):
    """A room failed. ``status`` is what the stage server answers its client."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def bad_gateway(message: str) -> DisaggError:
    """The other stage failed or went away."""
    return DisaggError(502, message, "peer_failed")


def timed_out(message: str) -> DisaggError:
    return DisaggError(504, message, "room_timeout")


def conflict(message: str) -> DisaggError:
    return DisaggError(409, message, "room_conflict")


def unavailable(message: str) -> DisaggError:
    return DisaggError(503, message, "kv_pool_full")
