"""Errors of a disaggregated request, each with the HTTP status the stage server answers.

Each kind says what failed, so a client (and the other stage, which gets the message as the
room's ``KVFailed`` reason, and its code and image key as that message's ``code`` and ``image_key``)
can tell a dead or slow peer from this stage's own failure:

    bad_gateway      502 peer_failed         the other stage failed, refused or went away
    transfer_failed  502 kv_transfer_failed  a KV write failed (``transfer.base.TransferError`` only)
    timed_out        504 room_timeout        a room's deadline passed
    conflict         409 room_conflict       the room is already in flight, answered or aborted
    unavailable      503 kv_pool_full        no KV blocks for the request now (with ``Retry-After``: back-pressure,
                                             another decode may take it)
    internal         500 internal_error      this stage failed on its own (a bug, an engine failure)
    not_allowed      403 bootstrap_not_allowed  the request names a prefill --allowed-bootstrap does not allow
"""

from __future__ import annotations


class DisaggError(RuntimeError):
    """A room failed. ``status`` is what the stage server answers its client; ``image_key``: the
    image the failure is about (EPD, ``stages.disagg.embeddings``), a typed field of the answer;
    ``peer_code``: a decode reporting its prefill's failure (``peer_failed``), the prefill's own code
    for it, a typed field of the answer too (None when the prefill sent none)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, *,
                 image_key: str | None = None, retry_after_s: int | None = None,
                 peer_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.image_key = image_key
        self.retry_after_s = retry_after_s  # answered as ``Retry-After``: the stage is busy, not failing
        self.peer_code = peer_code


def bad_gateway(message: str, *, peer_code: str | None = None, image_key: str | None = None) -> DisaggError:
    """The other stage failed or went away; ``peer_code`` and ``image_key``: the other stage's own
    code and image for its failure, when it sent them (the room's ``KVFailed`` / ``Rejected``)."""
    return DisaggError(502, message, "peer_failed", image_key=image_key, peer_code=peer_code)


def transfer_failed(room: int, reason: str) -> DisaggError:
    """The KV write of ``room`` into the decode's blocks failed; ``reason`` is the transfer backend's."""
    return DisaggError(502, f"bootstrap room {room}: KV transfer failed: {reason}", "kv_transfer_failed")


def timed_out(message: str) -> DisaggError:
    return DisaggError(504, message, "room_timeout")


def conflict(message: str) -> DisaggError:
    return DisaggError(409, message, "room_conflict")


def unavailable(message: str) -> DisaggError:
    return DisaggError(503, message, "kv_pool_full", retry_after_s=1)


def internal(message: str) -> DisaggError:
    """This stage failed for a reason of its own; ``message`` names the exception class and its text."""
    return DisaggError(500, message, "internal_error")


def not_allowed(message: str) -> DisaggError:
    """The request names a prefill this decode may not dial; nothing was dialed or reserved."""
    return DisaggError(403, message, "bootstrap_not_allowed", param="bootstrap_host")
