"""Image and video parts of a chat body and which remote hosts may be named. Pure.

``data:`` URLs pass through to the stages (which decode and check them); http(s) URLs are fetched
by the router (``router.plan.image_fetch``), only from ``--allowed-image-hosts`` (images and videos
alike), and replaced by ``data:`` URLs, so a stage never dials an address a request body names. Any
other scheme is a 400.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from cache.image_bytes import ImageRefused
from contract.errors import Code
from router.errors import RouterError, bad_request
from router.plan.limits import too_many_images

T = TypeVar("T")

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class ImagePart:
    """An ``image_url`` part, or (``kind`` ``video_url``) a video part: the same shapes, the same fetch."""

    part: dict  # the content part itself, rewritten in place when the URL is replaced
    url: str
    param: str  # messages[i].content[j].image_url (or .video_url), for error bodies
    kind: str = "image_url"

    @property
    def noun(self) -> str:
        """"image" or "video", for messages."""
        return self.kind.removesuffix("_url")

    def replace_url(self, url: str) -> None:
        field = self.part.get(self.kind)
        if isinstance(field, dict):
            field["url"] = url
        else:
            self.part[self.kind] = url


def image_parts(body: dict) -> list[ImagePart]:
    """Every ``image_url`` part, in conversation order. Malformed messages are skipped: the stage's
    schema check answers them with its own 400."""
    return media_parts(body, "image_url")


def media_parts(body: dict, kind: str) -> list[ImagePart]:
    """Every part of type ``kind`` (``image_url`` or ``video_url``: ``{"url": ...}`` or the URL itself),
    in conversation order, as ``image_parts``."""
    found = []
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != kind:
                continue
            field = part.get(kind)
            url = field.get("url") if isinstance(field, dict) else field
            if isinstance(url, str):
                found.append(ImagePart(part, url, f"messages[{i}].content[{j}].{kind}", kind))
    return found


def check_count(count: int, own: int, stages: int | None) -> None:
    """400 if a request with ``count`` images is over the router's ``--max-images-per-request`` (``own``)
    or the stages' tighter limit (``stages``; None: unknown), in the words of whose limit it is."""
    if stages is not None and stages < own and count > stages:
        raise too_many_images(count, stages)
    if count > own:
        raise bad_request(f"The request has {count} images; this router accepts at most {own} "
                          "(--max-images-per-request).", "messages", Code.TOO_MANY_IMAGES)


def check_remote(url: str, allowed: tuple[str, ...], param: str, noun: str = "image") -> None:
    """Raise 400 unless ``url`` is http(s) on a host (or host:port) in ``allowed``. ``noun``: "image"
    or "video" (the messages' word; a video's bad URL is ``invalid_video_url``, a host off the list
    ``image_host_not_allowed`` for both: one allow-list)."""
    invalid = Code.INVALID_VIDEO_URL if noun == "video" else Code.INVALID_IMAGE_URL
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower())
    except ValueError:
        raise bad_request(f"The {noun} URL is not a valid URL: {url[:100]!r}.", param, invalid) from None
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in DEFAULT_PORTS or not host:
        raise bad_request(f"{noun}_url must be a data: URL or an http(s) URL.", param, invalid)
    if not any(_matches(entry, host, port) for entry in allowed):
        raise RouterError(400, f"{noun.capitalize()} URLs on host {host!r} are not fetched by this router; add it "
                          f"to --allowed-image-hosts or send the {noun} as a data: URL.", param=param,
                          code=Code.IMAGE_HOST_NOT_ALLOWED)


def as_router_error(param: str, parse: Callable[..., T], *args: Any) -> T:
    """``parse(*args)`` (a ``cache.image_bytes`` function); its ``ImageRefused`` as a RouterError of the
    same status, code and message naming ``param``."""
    try:
        return parse(*args)
    except ImageRefused as exc:
        raise refusal(exc, param) from None


def refusal(refused: ImageRefused, param: str) -> RouterError:
    """A ``cache.image_bytes`` refusal as the router's error naming the client's part."""
    return RouterError(refused.status, refused.message, code=refused.code, param=param)


def _matches(entry: str, host: str, port: int | None) -> bool:
    entry = entry.lower()
    if entry.startswith("["):  # [v6]:port or [v6]
        name, _, rest = entry[1:].partition("]")
        return name == host and (not rest or rest == f":{port}")
    name, sep, entry_port = entry.rpartition(":")
    if sep and entry_port.isdigit() and ":" not in name:
        return name == host and int(entry_port) == port
    return entry == host
