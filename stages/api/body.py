"""Reading a request body within a byte cap: refused from ``Content-Length`` before a byte is read,
and cut off while streaming when a body without (or lying about) its length runs over."""

from __future__ import annotations

from fastapi import Request

from stages.api.errors import APIError, bad_request


def body_too_large(size: int | str, max_bytes: int) -> APIError:
    return APIError(413, f"The request body is {size} bytes; this server accepts at most {max_bytes} bytes "
                    "(--max-body-mb).", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or APIError 413 as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"Invalid Content-Length header: {declared!r}.", code="invalid_content_length")
        if int(declared) > max_bytes:
            raise body_too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(f"more than {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)
