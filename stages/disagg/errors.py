"""Errors of a disaggregated request, each with the HTTP status the stage server answers.

Each kind says what failed (its code and status: ``contract.errors``), so a client (and the other stage, which gets the message as the
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

from contract.bootstrap import BOOTSTRAP_HOST
from contract.errors import Code


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
    return DisaggError(Code.PEER_FAILED.status, message, Code.PEER_FAILED, image_key=image_key, peer_code=peer_code)


def transfer_failed(room: int, reason: str) -> DisaggError:
    """The KV write of ``room`` into the decode's blocks failed; ``reason`` is the transfer backend's."""
    return DisaggError(Code.KV_TRANSFER_FAILED.status, f"bootstrap room {room}: KV transfer failed: {reason}",
                       Code.KV_TRANSFER_FAILED)


def timed_out(message: str) -> DisaggError:
    return DisaggError(Code.ROOM_TIMEOUT.status, message, Code.ROOM_TIMEOUT)


def conflict(message: str) -> DisaggError:
    return DisaggError(Code.ROOM_CONFLICT.status, message, Code.ROOM_CONFLICT)


def unavailable(message: str) -> DisaggError:
    return DisaggError(Code.KV_POOL_FULL.status, message, Code.KV_POOL_FULL, retry_after_s=1)


def internal(message: str) -> DisaggError:
    """This stage failed for a reason of its own; ``message`` names the exception class and its text."""
    return DisaggError(Code.INTERNAL_ERROR.status, message, Code.INTERNAL_ERROR)


def not_allowed(message: str) -> DisaggError:
    """The request names a prefill this decode may not dial; nothing was dialed or reserved."""
    return DisaggError(Code.BOOTSTRAP_NOT_ALLOWED.status, message, Code.BOOTSTRAP_NOT_ALLOWED, param=BOOTSTRAP_HOST)
