"""Fetching http(s) image and video URLs from allowed hosts and turning them into ``data:`` URLs.

Limits: the host allow-list (checked before dialing; one list, ``--allowed-image-hosts``, for images
and videos), ``--image-fetch-timeout-s`` for the whole fetch, ``--max-image-bytes`` (a video:
``--max-video-mb``) from Content-Length and while reading, and no redirects (a redirect could lead off
the allow-list). Every refusal is an OpenAI-style 400 or 413 naming the part.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, replace

import aiohttp

from cache.image_bytes import ImageBounds, too_many_bytes, url_scheme
from cache.video_bytes import VideoBounds
from cache.video_bytes import too_many_bytes as too_many_video_bytes
from contract.errors import Code
from router.config import RouterConfig
from router.errors import RouterError, bad_request
from router.plan.images import ImagePart, check_count, check_remote, image_parts, refusal
from router.plan.videos import check_video_count, not_supported, video_parts


@dataclass(frozen=True)
class Resolved:
    """A request's image and video parts, in conversation order, each with its ``data:`` URL (the
    body rewritten where one was fetched: ``fetched``)."""

    images: list[ImagePart]
    videos: list[ImagePart]
    fetched: bool


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
        Returns the parts, in conversation order, each with its data: URL (``resolve_media``: videos too)."""
        return (await self.resolve_media(body, stage_max_images)).images

    async def resolve_media(self, body: dict, stage_max_images: int | None = None,
                            stage_max_videos: int | None = None, no_video: str | None = None) -> Resolved:
        """``resolve`` for images and videos together: both counts (videos: ``--max-videos-per-request``,
        or the stages' tighter ``stage_max_videos``); ``no_video``: the model's name when the stages take
        no video (a video part is then a 400 ``video_not_supported``, before anything is fetched); every
        remote URL checked before any is fetched; all fetched concurrently."""
        images = image_parts(body)
        check_count(len(images), self.config.max_images_per_request, stage_max_images)
        videos = video_parts(body)
        check_video_count(len(videos), self.config.max_videos_per_request, stage_max_videos)
        if videos and no_video is not None:
            raise not_supported(no_video, videos[0].param)
        remote = []
        for part in (*images, *videos):
            if url_scheme(part.url) != "data":  # 400 unless http(s) on an allowed host
                check_remote(part.url, self.config.allowed_image_hosts, part.param, part.noun)
                remote.append(part)
        if not remote:
            return Resolved(images, videos, False)
        tasks = [asyncio.ensure_future(self._fetch(part)) for part in remote]
        try:
            urls = await asyncio.gather(*tasks)
        finally:  # one refusal ends the others' fetches
            for task in tasks:
                task.cancel()
        now = {}
        for part, url in zip(remote, urls):
            part.replace_url(url)
            now[id(part)] = replace(part, url=url)
        return Resolved([now.get(id(p), p) for p in images], [now.get(id(p), p) for p in videos], True)

    async def _fetch(self, part: ImagePart) -> str:
        video = part.kind == "video_url"
        limit = self.config.max_video_bytes if video else self.config.max_image_bytes
        noun = part.noun
        try:
            async with self._client().get(part.url, allow_redirects=False) as response:
                if response.status != 200:
                    raise bad_request(f"Fetching the {noun} URL answered HTTP {response.status}.", part.param,
                                      Code.IMAGE_FETCH_FAILED)
                if response.content_length is not None and response.content_length > limit:
                    raise _too_large(response.content_length, limit, part)
                data = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(f"more than {limit}", limit, part)
                default = "video/mp4" if video else "image/unknown"
                media = response.content_type if response.content_type.startswith(f"{noun}/") else default
        except TimeoutError:
            raise bad_request(f"Fetching the {noun} URL took longer than {self.config.image_fetch_timeout_s:g} s "
                              "(--image-fetch-timeout-s).", part.param, Code.IMAGE_FETCH_FAILED) from None
        except aiohttp.ClientError as exc:
            raise bad_request(f"Fetching the {noun} URL failed: {type(exc).__name__}: {exc}", part.param,
                              Code.IMAGE_FETCH_FAILED) from None
        return f"data:{media};base64,{base64.b64encode(bytes(data)).decode()}"


def _too_large(size: int | str, limit: int, part: ImagePart) -> RouterError:
    """413 ``image_too_large`` over ``--max-image-bytes``, ``video_too_large`` over ``--max-video-mb``."""
    if part.kind == "video_url":  # only max_bytes is read; the other bounds are placeholders
        refused = too_many_video_bytes(size, VideoBounds(limit, 1, 1.0, 1.0, holder="router"))
        return RouterError(refused.status, refused.message, code=refused.code, param=part.param)
    return refusal(too_many_bytes(size, ImageBounds(limit, holder="router")), part.param)
