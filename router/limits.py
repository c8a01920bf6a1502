"""The stages' own request limits, as the router learns them, and its refusals on their behalf. Pure.

Each stage publishes in its ``/server_info`` ``limits`` what it refuses a request for before any
work (``stages.resources.limits_info``). The router reads them when it registers a worker
(``router.discovery``) and, before any fan-out, refuses a request that the tightest of them over its
workers would refuse, with the status, code and message shape the stage would give. A limit a
worker does not publish (or publishes malformed) is not known, and not enforced for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cache.image_bytes import TOO_MANY_IMAGES
from router.errors import RouterError, bad_request

ENFORCED = ("max_body_bytes", "max_images_per_request")


@dataclass(frozen=True)
class StageLimits:
    """The limits the router enforces for its stages; None: no stage published one."""

    max_body_bytes: int | None = None
    max_images_per_request: int | None = None

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in ENFORCED}


def published(info: dict) -> dict[str, int]:
    """The enforced limits in a stage's ``/server_info``: positive integers only."""
    limits = info.get("limits")
    if not isinstance(limits, dict):
        return {}
    return {name: value for name in ENFORCED if type(value := limits.get(name)) is int and value > 0}


def tightest(each: Iterable[dict[str, int]]) -> StageLimits:
    """The smallest value of each limit over the workers' published limits."""
    found: dict[str, int] = {}
    for limits in each:
        for name, value in limits.items():
            found[name] = min(value, found.get(name, value))
    return StageLimits(**found)


def too_many_images(count: int, limit: int) -> RouterError:
    """A stage's 400 for more than ``--max-images-per-request`` images, given by the router."""
    return bad_request(f"The request has {count} images; the stages behind this router accept at most {limit} "
                       "per request (their --max-images-per-request).", "messages", TOO_MANY_IMAGES)


def body_too_large(size: int | str, limit: int) -> RouterError:
    """A stage's 413 for a body over its ``--max-body-mb``, given by the router."""
    return RouterError(413, f"The request body is {size} bytes; the stages behind this router accept at most "
                       f"{limit} bytes (their --max-body-mb).", code="request_too_large")
