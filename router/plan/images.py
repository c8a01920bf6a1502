"""Image parts of a chat body and which remote hosts may be named. Pure.

``data:`` URLs pass through to the stages (which decode and check them); http(s) URLs are fetched
by the router (``router.plan.image_fetch``), only from ``--allowed-image-hosts``, and replaced by
``data:`` URLs, so a stage never dials an address a request body names. Any other scheme is a 400.
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
    part: dict  # the content part itself, rewritten in place when the URL is replaced
    url: str
    param: str  # messages[i].content[j].image_url, for error bodies

    def replace_url(self, url: str) -> None:
        image_url = self.part.get("image_url")
        if isinstance(image_url, dict):
            image_url["url"] = url
        else:
            self.part["image_url"] = url


def image_parts(body: dict) -> list[ImagePart]:
    """Every ``image_url`` part, in conversation order. Malformed messages are skipped: the stage's
    schema check answers them with its own 400."""
    found = []
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if isinstance(url, str):
                found.append(ImagePart(part, url, f"messages[{i}].content[{j}].image_url"))
    return found


def check_count(count: int, own: int, stages: int | None) -> None:
    """400 if a request with ``count`` images is over the router's ``--max-images-per-request`` (``own``)
    or the stages' tighter limit (``stages``; None: unknown), in the words of whose limit it is."""
    if stages is not None and stages < own and count > stages:
        raise too_many_images(count, stages)
    if count > own:
        raise bad_request(f"The request has {count} images; this router accepts at most {own} "
                          "(--max-images-per-request).", "messages", Code.TOO_MANY_IMAGES)


def check_remote(url: str, allowed: tuple[str, ...], param: str) -> None:
    """Raise 400 unless ``url`` is http(s) on a host (or host:port) in ``allowed``."""
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower())
    except ValueError:
        raise bad_request(f"The image URL is not a valid URL: {url[:100]!r}.", param, Code.INVALID_IMAGE_URL) from None
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in DEFAULT_PORTS or not host:
        raise bad_request("image_url must be a data: URL or an http(s) URL.", param, Code.INVALID_IMAGE_URL)
    if not any(_matches(entry, host, port) for entry in allowed):
        raise RouterError(400, f"Image URLs on host {host!r} are not fetched by this router; add it to "
                          "--allowed-image-hosts or send the image as a data: URL.", param=param,
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
