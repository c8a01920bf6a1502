"""``cache.image_bytes``, the one image parser (pure): data URLs, base64, non-image bytes, truncated
headers, huge dimensions, the pixel limit read from the header alone. Its refusals' codes are the
contract's (``contract.errors.Code``; tests/contract checks that no module spells one)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image, ImageFile

from cache.image_bytes import (ImageBounds, ImageRefused, base64_bytes, check_size, data_url_bytes, decoded_image,
                               header_size, too_many_bytes)
from contract.errors import Code
from router.config import RouterConfig
from router.errors import RouterError
from router.plan.image_fetch import ImageFetcher
from tests.support.stage_api import data_url, png, png_header_only

BOUNDS = ImageBounds(max_bytes=4_000, max_pixels=10_000)


def refused(fn, *args) -> ImageRefused:
    with pytest.raises(ImageRefused) as info:
        fn(*args)
    return info.value


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


# --- data URLs and base64 ----------------------------------------------------------------------
@pytest.mark.unit
def test_a_data_url_gives_the_files_bytes():
    data = png(20, 10)
    assert data_url_bytes(data_url(data), BOUNDS) == data
    assert data_url_bytes("DATA:image/png;base64," + base64.b64encode(data).decode(), BOUNDS) == data
    assert base64_bytes(base64.b64encode(data).decode(), BOUNDS) == data


@pytest.mark.unit
@pytest.mark.parametrize("url, status, code, message", [
    ("https://example.com/cat.png", 400, Code.REMOTE_IMAGE_URL, "Remote image URLs are not fetched by stage servers; "
     "send the image as a data: URL (base64), or send the request through the router, which fetches allowed URLs."),
    ("HTTP://example.com/cat.png", 400, Code.REMOTE_IMAGE_URL, "Remote image URLs are not fetched by stage servers; "
     "send the image as a data: URL (base64), or send the request through the router, which fetches allowed URLs."),
    ("ftp://example.com/cat.png", 400, Code.INVALID_IMAGE_URL, "image_url must be a data: URL (data:image/...;base64,...)."),
    ("cat.png", 400, Code.INVALID_IMAGE_URL, "image_url must be a data: URL (data:image/...;base64,...)."),
    ("data:image/png,rawbytes", 400, Code.INVALID_IMAGE_URL,
     "Image data URLs must be base64 encoded (data:image/...;base64,...)."),
    ("data:image/png;base64", 400, Code.INVALID_IMAGE_URL,
     "Image data URLs must be base64 encoded (data:image/...;base64,...)."),
    ("data:image/png;base64,@@not*base64@@", 400, Code.INVALID_BASE64, "The image data URL is not valid base64."),
    ("data:image/png;base64,abc", 400, Code.INVALID_BASE64, "The image data URL is not valid base64."),  # bad padding
    ("data:image/png;base64,aGk=\n", 400, Code.INVALID_BASE64, "The image data URL is not valid base64."),  # not strict
], ids=["https", "HTTP", "ftp", "no-scheme", "not-base64-encoded", "no-comma", "bad-characters", "bad-padding",
        "newline"])
def test_a_bad_data_url_is_refused_with_its_code(url, status, code, message):
    error = refused(data_url_bytes, url, BOUNDS)
    assert (error.status, error.code, error.message) == (status, code, message)


@pytest.mark.unit
def test_bad_plain_base64_is_refused():
    error = refused(base64_bytes, "not base64!", BOUNDS)
    assert (error.status, error.code, error.message) == (400, Code.INVALID_BASE64, "The image data is not valid base64.")


@pytest.mark.unit
def test_the_byte_limit_is_exact_and_names_who_holds_it():
    exact = ImageBounds(max_bytes=3_000)
    assert len(data_url_bytes(data_url(b"x" * 3_000), exact)) == 3_000
    error = refused(data_url_bytes, data_url(b"x" * 3_001), exact)
    assert (error.status, error.code, error.message) == (
        413, Code.IMAGE_TOO_LARGE, "The image is 3001 bytes; this server accepts at most 3000 bytes per image "
        "(--max-image-bytes).")
    router = ImageBounds(max_bytes=3_000, holder="router")
    assert refused(base64_bytes, base64.b64encode(b"x" * 3_001).decode(), router).message == (
        "The image is 3001 bytes; this router accepts at most 3000 bytes per image (--max-image-bytes).")
    assert too_many_bytes("more than 3000", router).message.startswith("The image is more than 3000 bytes; ")


@pytest.mark.unit
def test_a_payload_far_over_the_limit_is_refused_before_decoding():
    """Bounded by its length before base64 decodes it: characters that are not base64 at all are not
    even looked at (413, not the 400 decoding would give)."""
    error = refused(data_url_bytes, "data:image/png;base64," + "*" * 40_000, BOUNDS)
    assert (error.status, error.code, error.message) == (
        413, Code.IMAGE_TOO_LARGE, "The image is 30000 bytes; this server accepts at most 4000 bytes per image "
        "(--max-image-bytes).")


# --- what the bytes are ------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "WEBP"])
def test_a_file_of_each_format_gives_its_size_and_pixels(fmt):
    data = encoded(Image.new("RGB", (37, 23), (10, 200, 30)), fmt)
    assert header_size(data, BOUNDS) == (37, 23)
    image = decoded_image(data, BOUNDS)
    assert image.size == (37, 23) and image.convert("RGB").getpixel((0, 0))[1] > 150


@pytest.mark.unit
@pytest.mark.parametrize("data", [b"this is not an image at all", b"", b"\x89PNG\r\n\x1a\n"],
                         ids=["text", "nothing", "png-signature-only"])
def test_bytes_that_are_no_image_are_invalid_image(data):
    for read in (header_size, decoded_image):
        error = refused(read, data, BOUNDS)
        assert (error.status, error.code, error.message) == (
            400, Code.INVALID_IMAGE, "The image data is not an image in a supported format.")


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL warns of TIFF's truncated EXIF while it reads
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"])
def test_every_truncation_of_a_file_gives_its_true_size_or_invalid_image(fmt):
    """Cut after each byte, a file is read as its true size or refused 400 ``invalid_image``: no other
    exception escapes, from the header read or the pixel decode."""
    data = encoded(Image.new("RGB", (37, 23), (10, 200, 30)), fmt)
    refusals = 0
    for end in range(len(data)):
        for read in (header_size, decoded_image):
            try:
                result = read(data[:end], BOUNDS)
            except ImageRefused as error:
                assert (error.status, error.code) == (400, Code.INVALID_IMAGE), (end, read.__name__, error.message)
                refusals += 1
                continue
            assert (result if read is header_size else result.size) == (37, 23), (end, read.__name__)
    assert refusals >= len(data) // 2  # most cuts lose pixel data, and decoding notices


@pytest.mark.unit
def test_a_truncated_file_has_its_size_from_the_header_but_does_not_decode():
    whole = png(64, 64, (5, 5, 5))
    cut = whole[:len(whole) // 2]
    assert header_size(cut, BOUNDS) == (64, 64)
    error = refused(decoded_image, cut, BOUNDS)
    assert (error.status, error.code) == (400, Code.INVALID_IMAGE)
    assert error.message.startswith("The image could not be decoded: ")


# --- sizes -------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_pixel_limit_is_read_from_the_header_without_decoding_a_pixel(monkeypatch):
    def no_pixels(self):  # noqa: ANN001
        raise AssertionError("a pixel was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_pixels)
    message = ("The image is 200x100 = 20000 pixels; this server accepts at most 10000 pixels per image "
               "(--max-image-pixels).")
    for read in (header_size, decoded_image):  # the decode refuses before it would load
        error = refused(read, png_header_only(200, 100), BOUNDS)
        assert (error.status, error.code, error.message) == (413, Code.IMAGE_TOO_LARGE, message)
    assert header_size(png_header_only(100, 100), BOUNDS) == (100, 100)  # exactly at the limit is fine


@pytest.mark.unit
@pytest.mark.parametrize("max_pixels", [10**12, None], ids=["limit-above-pil", "no-limit"])
def test_a_decompression_bomb_header_is_413_from_the_header(max_pixels):
    """A canvas of 10^10 pixels is refused by PIL's guard while the header is read, whatever our limit."""
    bounds = ImageBounds(max_bytes=4_000, max_pixels=max_pixels)
    for read in (header_size, decoded_image):
        error = refused(read, png_header_only(100_000, 100_000), bounds)
        assert (error.status, error.code) == (413, Code.IMAGE_TOO_LARGE)
        assert error.message == ("The image is too large to decode safely: its header claims more than "
                                 f"{2 * Image.MAX_IMAGE_PIXELS} pixels.")


@pytest.mark.unit
def test_huge_dimensions_under_pils_guard_are_held_by_the_pixel_limit_alone():
    tall = png_header_only(1, 50_000_000)
    assert header_size(tall, ImageBounds(max_bytes=4_000)) == (1, 50_000_000)  # no pixel limit: the size is read
    assert refused(header_size, tall, ImageBounds(max_bytes=4_000, max_pixels=16_777_216)).status == 413


@pytest.mark.unit
def test_check_size():
    check_size(100, 100, BOUNDS)
    empty = refused(check_size, 0, 5, BOUNDS)
    assert (empty.status, empty.code, empty.message) == (400, Code.INVALID_IMAGE, "The image is empty.")
    assert refused(check_size, 101, 100, BOUNDS).status == 413
    check_size(10**6, 10**6, ImageBounds(max_bytes=1))  # no pixel limit


@pytest.mark.unit
@pytest.mark.parametrize("max_bytes, max_pixels", [(0, None), (-1, 5), (10, 0)])
def test_bounds_must_be_positive(max_bytes, max_pixels):
    with pytest.raises(ValueError, match="image limits must be > 0"):
        ImageBounds(max_bytes, max_pixels)


# --- the router's side ------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("url, message", [
    ("ftp://img.example/a.png", "image_url must be a data: URL or an http(s) URL."),
    ("cat.png", "image_url must be a data: URL or an http(s) URL."),
    ("http://img.example:99999/a.png", "The image URL is not a valid URL: 'http://img.example:99999/a.png'."),
])
async def test_the_router_refuses_a_url_it_would_not_fetch_before_dialing(url, message):
    """Any scheme but data: and http(s) is refused naming the part, before a fetch session exists."""
    fetcher = ImageFetcher(RouterConfig(colocated=("http://127.0.0.1:1",), allowed_image_hosts=("img.example",)))
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    with pytest.raises(RouterError) as info:
        await fetcher.resolve(body)
    error = info.value
    assert (error.status, error.code, error.param, error.message) == (
        400, Code.INVALID_IMAGE_URL, "messages[0].content[1].image_url", message)
    assert fetcher._session is None

