"""The stages' own request limits, as the router learns them, and its refusals on their behalf. Pure.

Each stage publishes in its ``/server_info`` ``limits`` what it refuses a request for before any
work (``stages.resources.limits_info``). The router reads them when it registers a worker
(``router.fleet.discovery``) and, before any fan-out, refuses a request that the tightest of them over its
workers would refuse, with the status, code and message shape the stage would give. A limit a
worker does not publish (or publishes malformed) is not known, and not enforced for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from contract.errors import Code
from router.errors import RouterError, bad_request

ENFORCED = ("max_body_bytes", "max_images_per_request", "max_videos_per_request", "max_model_len", "chars_per_token")
_NON_SPACE = re.compile(r"\S")
_TAIL_CHARS = 4096  # a text whose last this many characters are all whitespace is left to the stage's exact count


@dataclass(frozen=True)
class StageLimits:
    """The limits the router enforces for its stages; None: no stage published one."""

    max_body_bytes: int | None = None
    max_images_per_request: int | None = None
    max_videos_per_request: int | None = None
    max_model_len: int | None = None  # the context, in tokens
    chars_per_token: int | None = None  # the most characters one token covers (None: no such bound)

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
                       "per request (their --max-images-per-request).", "messages", Code.TOO_MANY_IMAGES)


def too_many_videos(count: int, limit: int) -> RouterError:
    """A stage's 400 for more than ``--max-videos-per-request`` videos, given by the router."""
    return bad_request(f"The request has {count} videos; the stages behind this router accept at most {limit} "
                       "per request (their --max-videos-per-request).", "messages", Code.TOO_MANY_VIDEOS)


def body_too_large(size: int | str, limit: int) -> RouterError:
    """A stage's 413 for a body over its ``--max-body-mb``, given by the router."""
    return RouterError(413, f"The request body is {size} bytes; the stages behind this router accept at most "
                       f"{limit} bytes (their --max-body-mb).", code=Code.REQUEST_TOO_LARGE)


def prompt_too_long(body: dict, limits: StageLimits) -> RouterError | None:
    """The stages' 400 ``context_length_exceeded`` for messages whose text makes more tokens than the
    context holds (a text of C characters makes at least C / ``chars_per_token`` tokens; the stages'
    rule, ``stages.text_bound``), or None. Counts no more than the stages do, so the router never
    refuses what a stage would take; a body of another shape is left to the stages' own checks."""
    if limits.max_model_len is None or limits.chars_per_token is None:
        return None
    chars = prompt_chars(body.get("messages"))
    if chars <= (limits.max_model_len - 1) * limits.chars_per_token:
        return None
    return bad_request(f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
                       f"messages hold {chars} characters of text, at least {-(-chars // limits.chars_per_token)} "
                       f"tokens (a token covers at most {limits.chars_per_token} characters). Please reduce the "
                       "length of the messages.", "messages", Code.CONTEXT_LENGTH_EXCEEDED)


def prompt_chars(messages: object) -> int:
    """Characters of text the chat template writes into the prompt at least: every text of every
    message but an assistant's, less the whitespace at its ends (templates may trim it)."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        if not isinstance(message, dict) or message.get("role") == "assistant":
            continue
        content = message.get("content")
        texts = [part.get("text") for part in content if isinstance(part, dict)] if isinstance(content, list) \
            else [content]
        total += sum(_kept_chars(text) for text in texts if isinstance(text, str))
    return total


def _kept_chars(text: str) -> int:
    """``len(text.strip())`` without copying ``text``; 0 (not counted) when its last ``_TAIL_CHARS``
    characters are all whitespace."""
    first = _NON_SPACE.search(text)
    tail = text[-_TAIL_CHARS:]
    kept_tail = len(tail.rstrip())
    if first is None or not kept_tail:
        return 0
    return len(text) - len(tail) + kept_tail - first.start()
