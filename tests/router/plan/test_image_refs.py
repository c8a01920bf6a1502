"""Image references (router/plan/image_refs.py): a body's images read as keys of their bytes with
their sizes from the header, bad images refused naming the part, image parts replaced by
references without touching the body, the encoder's body with each image once. Pure: no sockets."""

from __future__ import annotations

import msgspec
import pytest

from cache.keys import image_key
from router.errors import RouterError
from router.plan.image_refs import encode_body, with_refs
from tests.support.router_epd import FP, body_with, refs_of
from tests.support.router_helpers import data_url, png

pytestmark = pytest.mark.unit


def refused(body: dict, max_bytes: int = 1 << 20) -> RouterError:
    with pytest.raises(RouterError) as error:
        refs_of(body, max_bytes)
    return error.value


# --- image references (pure) ------------------------------------------------------------------
def test_refs_carry_the_key_of_the_bytes_and_the_size_from_the_header():
    a, b = png(48, 32, 1), png(20, 64, 2)
    images = refs_of(body_with(a, b, a))
    assert [(im.key, im.width, im.height) for im in images] == [
        (image_key(a, FP), 48, 32), (image_key(b, FP), 20, 64), (image_key(a, FP), 48, 32)]


@pytest.mark.parametrize("url, status, code, message", [
    ("data:image/png,abc", 400, "invalid_image_url", "Image data URLs must be base64 encoded"),
    ("data:image/png;base64,***", 400, "invalid_base64", "The image data URL is not valid base64."),
    (data_url(b"not an image at all"), 400, "invalid_image", "The image data is not an image in a supported format."),
    (data_url(b"x" * 3000), 413, "image_too_large", "The image is 3000 bytes; this router accepts at most 2048 "
                                                    "bytes per image (--max-image-bytes)."),
])
def test_bad_images_are_refused_naming_the_part(url, status, code, message):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    error = refused(body, max_bytes=2048)
    assert (error.status, error.code, error.param) == (status, code, "messages[0].content[1].image_url")
    assert error.message.startswith(message)


def test_with_refs_replaces_only_image_parts_and_leaves_the_body_alone():
    body = body_with(png(48, 32, 1), text="look")
    body["messages"].insert(0, {"role": "system", "content": "be brief"})
    original = msgspec.json.encode(body)
    images = refs_of(body)
    out = with_refs(body, images)
    assert msgspec.json.encode(body) == original
    assert out["messages"][0] is body["messages"][0]  # a message without images is not copied
    assert out["messages"][1]["content"] == [
        {"type": "image_ref", "image_ref": {"key": images[0].key, "width": 48, "height": 32}},
        {"type": "text", "text": "look"}]
    assert with_refs(body, []) is body


def test_encode_body_sends_each_image_once_as_its_data_url():
    a, b = png(48, 32, 1), png(20, 64, 2)
    images = refs_of(body_with(a, b, a))
    assert msgspec.json.decode(encode_body(7, images)) == {"room": 7, "images": [
        {"key": image_key(a, FP), "url": data_url(a)}, {"key": image_key(b, FP), "url": data_url(b)}]}
