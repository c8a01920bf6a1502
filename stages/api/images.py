"""The stage's side of ``cache.image_bytes``: its ``--max-image-*`` limits, and each refusal as an
``APIError`` naming the part (``param``).

Stage servers take ``data:`` URLs only; remote URLs are fetched by the router (from its allow-list),
never by a stage. The parsing, the order of the limits and the error codes are ``cache.image_bytes``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from PIL import Image

from cache import image_bytes
from cache.image_bytes import ImageBounds, ImageRefused
from stages.api.errors import APIError
from stages.config import ImageLimits

T = TypeVar("T")


def decode_data_url(url: str, limits: ImageLimits, param: str | None = None) -> bytes:
    """``data:image/png;base64,...`` -> the image's bytes. Raises APIError (400 or 413)."""
    return _as_api_error(param, image_bytes.data_url_bytes, url, bounds(limits))


def decode_base64(payload: str, limits: ImageLimits, param: str | None = None) -> bytes:
    """An image file sent as plain base64 -> its bytes. Raises APIError (400 or 413)."""
    return _as_api_error(param, image_bytes.base64_bytes, payload, bounds(limits))


def open_image(data: bytes, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """Bytes -> a fully decoded PIL image, the pixel count checked from the header first."""
    return _as_api_error(param, image_bytes.decoded_image, data, bounds(limits))


def load_image(url: str, limits: ImageLimits, param: str | None = None) -> Image.Image:
    return open_image(decode_data_url(url, limits, param), limits, param)


def image_size(url: str, limits: ImageLimits, param: str | None = None) -> tuple[int, int]:
    """(width, height) of a ``data:`` URL's image from its header alone: no pixel is decoded (a
    decode server needs only the size). Same limits and errors as ``load_image``, except that a
    file whose pixel data is broken past its header is not noticed here."""
    return header_size(decode_data_url(url, limits, param), limits, param)


def header_size(data: bytes, limits: ImageLimits, param: str | None = None) -> tuple[int, int]:
    """(width, height) of an image file's bytes from its header alone (see ``image_size``)."""
    return _as_api_error(param, image_bytes.header_size, data, bounds(limits))


def check_size(width: int, height: int, limits: ImageLimits, param: str | None = None) -> None:
    """An image's size within ``--max-image-pixels`` and not empty; APIError 413 or 400."""
    _as_api_error(param, image_bytes.check_size, width, height, bounds(limits))


def bounds(limits: ImageLimits) -> ImageBounds:
    return ImageBounds(limits.max_bytes, limits.max_pixels)


def _as_api_error(param: str | None, parse: Callable[..., T], *args: Any) -> T:
    """``parse(*args)``; its ``ImageRefused`` as an APIError of the same status, code and message naming ``param``."""
    try:
        return parse(*args)
    except ImageRefused as exc:
        raise APIError(exc.status, exc.message, param=param, code=exc.code) from None
