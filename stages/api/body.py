"""Reading a request body within a byte cap: refused from ``Content-Length`` before a byte is read,
and cut off while streaming when a body without (or lying about) its length runs over; and giving
the memory of a large body back once its request is done (``ReleaseMemory``)."""

from __future__ import annotations

import ctypes

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.errors import Code
from stages.api.errors import APIError, bad_request


def body_too_large(size: int | str, max_bytes: int) -> APIError:
    return APIError(413, f"The request body is {size} bytes; this server accepts at most {max_bytes} bytes "
                    "(--max-body-mb).", code=Code.REQUEST_TOO_LARGE)


async def read_body(request: Request, max_bytes: int) -> bytes | bytearray:
    """The whole body, or APIError 413 as soon as it is known to exceed ``max_bytes``. With a
    ``Content-Length``, the body is read into one buffer of that size (one copy of it in memory, where
    collecting pieces and joining them holds two)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"Invalid Content-Length header: {declared!r}.", param=None, code="invalid_content_length")
        if int(declared) > max_bytes:
            raise body_too_large(int(declared), max_bytes)
        return await _read_into(request, bytearray(int(declared)))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(f"more than {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_into(request: Request, body: bytearray) -> bytearray:
    """``body`` filled from the request (the server stops reading at ``Content-Length``)."""
    size = 0
    async for chunk in request.stream():
        if size + len(chunk) > len(body):
            raise body_too_large(f"more than its Content-Length of {len(body)}", len(body))
        body[size:size + len(chunk)] = chunk
        size += len(chunk)
    del body[size:]  # the client sent less (the server reports a disconnect first)
    return body


RELEASE_AFTER_BYTES = 1 << 20
# glibc only; CDLL(None) is the process's own symbol table (libc's included), found without
# ctypes.util.find_library, which runs ldconfig in a subprocess at import
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


class ReleaseMemory:
    """ASGI middleware: after a request whose body was at least ``RELEASE_AFTER_BYTES``, glibc's
    ``malloc_trim`` hands the freed heap back to the system. Without it the copies a large body
    leaves (the body, its decoded strings: each below glibc's 32 MiB mmap threshold lives in a heap
    arena) stay in the process's RSS after the request is answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _MALLOC_TRIM is None:
            await self.app(scope, receive, send)
            return
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if size >= RELEASE_AFTER_BYTES:
                await run_in_threadpool(_MALLOC_TRIM, 0)
