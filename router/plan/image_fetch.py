"""Fetching http(s) image URLs from allowed hosts and turning them into ``data:`` URLs.

Limits: the host allow-list (checked before dialing), ``--image-fetch-timeout-s`` for the whole
fetch, ``--max-image-bytes`` from Content-Length and while reading, and no redirects (a redirect
could lead off the allow-list). Every refusal is an OpenAI-style 400 or 413 naming the part.
"""

from __future__ import annotations

import asyncio
import base64

import aiohttp

from cache.image_bytes import ImageBounds, too_many_bytes, url_scheme
from contract.errors import Code
from router.config import RouterConfig
from router.errors import RouterError, bad_request
from router.plan.images import ImagePart, check_count, check_remote, image_parts, refusal


class ImageFetcher:
    """Owns one client session for image fetches; ``close()`` it when the router stops."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.config.image_fetch_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def resolve(self, body: dict, stage_max_images: int | None = None) -> list[ImagePart]:
        """Check the count (``--max-images-per-request``, or the stages' tighter ``stage_max_images``) and
        every image part, fetch the remote ones (concurrently) and rewrite them as data: URLs in ``body``.
        Returns the parts, in conversation order."""
        parts = image_parts(body)
        check_count(len(parts), self.config.max_images_per_request, stage_max_images)
        remote = []
        for part in parts:
            if url_scheme(part.url) != "data":  # 400 unless http(s) on an allowed host
                check_remote(part.url, self.config.allowed_image_hosts, part.param)
                remote.append(part)
        if not remote:
            return parts
        tasks = [asyncio.ensure_future(self._fetch(part)) for part in remote]
        try:
            urls = await asyncio.gather(*tasks)
        finally:  # one refusal ends the others' fetches
            for task in tasks:
                task.cancel()
        for part, url in zip(remote, urls):
            part.replace_url(url)
        return parts

    async def _fetch(self, part: ImagePart) -> str:
        limit = self.config.max_image_bytes
        try:
            async with self._client().get(part.url, allow_redirects=False) as response:
                if response.status != 200:
                    raise bad_request(f"Fetching the image URL answered HTTP {response.status}.", part.param,
                                      Code.IMAGE_FETCH_FAILED)
                if response.content_length is not None and response.content_length > limit:
                    raise _too_large(response.content_length, limit, part.param)
                data = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(f"more than {limit}", limit, part.param)
                media = response.content_type if response.content_type.startswith("image/") else "image/unknown"
        except TimeoutError:
            raise bad_request(f"Fetching the image URL took longer than {self.config.image_fetch_timeout_s:g} s "
                              "(--image-fetch-timeout-s).", part.param, Code.IMAGE_FETCH_FAILED) from None
        except aiohttp.ClientError as exc:
            raise bad_request(f"Fetching the image URL failed: {type(exc).__name__}: {exc}", part.param,
                              Code.IMAGE_FETCH_FAILED) from None
        return f"data:{media};base64,{base64.b64encode(bytes(data)).decode()}"


def _too_large(size: int | str, limit: int, param: str) -> RouterError:
    return refusal(too_many_bytes(size, ImageBounds(limit, holder="router")), param)
