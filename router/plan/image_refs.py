"""EPD mode: a request's images as cache references. Pure: no I/O.

The router turns each ``image_url`` part (a ``data:`` URL by now: remote URLs were fetched by
``router.plan.image_fetch``) into a ``RefImage``: the file's bytes decoded from base64, its cache key
``cache.keys.image_key(bytes, vision_fingerprint)`` and its width and height read from the file's
header (no pixel is decoded), parsed by ``cache.image_bytes`` as every stage parses them. The
prefill and the decode get the chat body with every such part replaced by ``{"type": "image_ref",
"image_ref": {"key", "width", "height"}}`` (``with_refs``; a video, by its ``video_ref``:
``router.plan.videos``); an encoder gets the ``data:`` URLs of the images (and videos) it must encode
(``encode_body``).

Every refusal is an OpenAI-style 400 or 413 naming the part (``messages[i].content[j].image_url``),
raised before anything is planned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from cache.image_bytes import ImageBounds, data_url_bytes, header_size
from cache.keys import image_key
from contract.encode import EncodeImage, EncodeRequest
from router.plan.images import ImagePart, as_router_error

_encode = msgspec.json.Encoder().encode


class Referenced(Protocol):
    """An image (``RefImage``) or a video (``router.plan.videos.RefVideo``) sent as a reference."""

    @property
    def part(self) -> dict: ...

    @property
    def key(self) -> str | None: ...

    @property
    def param(self) -> str: ...

    def ref(self) -> dict: ...

    def encoded(self) -> EncodeImage: ...


@dataclass(frozen=True)
class RefImage:
    part: dict  # the client's content part (not modified)
    url: str  # its data: URL, as the encoder takes it
    key: str
    width: int
    height: int
    param: str  # the client's path of the part, messages[i].content[j].image_url (``router.dispatch.client_params``)

    def ref(self) -> dict:
        return {"type": "image_ref", "image_ref": {"key": self.key, "width": self.width, "height": self.height}}

    def encoded(self) -> EncodeImage:
        """The encoder's ``EncodeImage``: the data: URL with its key."""
        return EncodeImage(key=self.key, url=self.url)


def ref_images(parts: Sequence[ImagePart], fingerprint: str, max_bytes: int) -> list[RefImage]:
    """Each part as a ``RefImage``, in order. 400 ``invalid_image_url`` / ``invalid_base64`` /
    ``invalid_image``, 413 ``image_too_large`` (over ``max_bytes``, or a canvas PIL refuses)."""
    bounds = ImageBounds(max_bytes, holder="router")
    return [_ref_image(part, fingerprint, bounds) for part in parts]


def _ref_image(part: ImagePart, fingerprint: str, bounds: ImageBounds) -> RefImage:
    data = as_router_error(part.param, data_url_bytes, part.url, bounds)
    width, height = as_router_error(part.param, header_size, data, bounds)
    return RefImage(part.part, part.url, image_key(data, fingerprint), width, height, part.param)


def with_refs(body: dict, images: Sequence[Referenced], videos: Sequence[Referenced] = ()) -> dict:
    """A copy of ``body`` whose image (and video) parts are replaced by their references, without
    ``mm_processor_kwargs`` when it has videos (their sampling travels resolved in each ``video_ref``);
    ``body`` is unchanged, and only the messages and contents that hold a reference are copied."""
    if not images and not videos:
        return body
    refs = {id(item.part): item.ref() for item in (*images, *videos)}
    messages = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(id(part) in refs for part in content):
            message = {**message, "content": [refs.get(id(part), part) for part in content]}
        messages.append(message)
    return {**{k: v for k, v in body.items() if not (videos and k == "mm_processor_kwargs")}, "messages": messages}


def encode_body(room: int, items: Iterable[Referenced]) -> bytes:
    """An encoder's ``POST /v1/encode`` body (``docs/protocol.md``): each image (or video) once, with its key."""
    unique = {item.key: item for item in items}
    return _encode(EncodeRequest(room, [item.encoded() for item in unique.values()]))
