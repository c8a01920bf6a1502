"""Video parts through the router (issue 33), in-process: the router's own routes, server and upstream
client in front of fake stages (aiohttp apps that publish a ``/server_info`` like a stage's, with its
``video`` and ``limits``, and record every body they get). Every refusal comes before any fan-out: too
many videos, a video host off the allow-list, a model that takes no video, a corrupt video, bad
``mm_processor_kwargs``; a remote video is fetched into a ``data:`` URL; in epd mode the prefill and the
decode get a ``video_ref`` under the right key and the encoder the video with its resolved sampling."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from aiohttp import web

from cache.keys import video_key
from contract.video import VideoSampling
from process.ports import bind
from router.app import create_routes
from router.config import RouterConfig
from router.http import HttpServer
from router.runtime import Router
from tests.support.redis_fixtures import redis_server, redis_url  # noqa: F401
from tests.support.router_epd import FP
from tests.support.videos import data_url, make_video

pytestmark = pytest.mark.timeout(60)
CHAT = "/v1/chat/completions"
SAMPLING = VideoSampling.from_processor_config("qwen2_vl", {})
VIDEO = {"sampling": SAMPLING.to_json(), "max_bytes": 1 << 20, "max_pixels": 640 * 480, "max_seconds": 60.0,
         "max_frames": 64, "decode_timeout_s": 10.0}
KV_FP = {"model": "m", "block_size": 16}
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
UNSET = object()


def answering(value: dict):
    async def handler(_: web.Request) -> web.Response:
        return web.json_response(value)
    return handler


class FakeStage:
    """A stage of ``role`` that answers discovery and health, and records the bodies it is sent."""

    def __init__(self, role: str, video: object = VIDEO, max_videos: int = 4) -> None:
        self.role, self.video = role, video
        self.limits = {"max_videos_per_request": max_videos, "max_images_per_request": 8}
        self.chats: list[dict] = []
        self.encodes: list[dict] = []
        self.app = web.Application(client_max_size=64 << 20)
        self.app.router.add_get("/health", answering({"status": "ok"}))
        self.app.router.add_get("/v1/models", answering({"object": "list", "data": [{"id": "m", "object": "model"}]}))
        self.app.router.add_get("/server_info", self._info)
        self.app.router.add_post(CHAT, self._chat)
        self.app.router.add_post("/v1/encode", self._encode)

    async def _info(self, _: web.Request) -> web.Response:
        info: dict = {"role": self.role, "limits": self.limits}
        if self.video is not UNSET:
            info["video"] = self.video
        if self.role in ("prefill", "decode"):
            info["fingerprint"] = KV_FP
        if self.role == "prefill":
            info["bootstrap"] = {"host": "127.0.0.1", "port": 9}
        if self.role == "encoder":
            info |= {"model": "m", "encoder_id": "enc-1", "vision_fingerprint": FP}
        return web.json_response(info)

    async def _chat(self, request: web.Request) -> web.Response:
        self.chats.append(await request.json())
        return web.json_response(ANSWER)

    async def _encode(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.encodes.append(body)
        return web.json_response({"room": body["room"], "images": [
            {"key": image["key"], "status": "encoded", "num_tokens": 1, "seconds": 0.0} for image in body["images"]]})


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def routed(config: RouterConfig) -> AsyncIterator[httpx.AsyncClient]:
    """The router of ``config`` started and listening; a client on it."""
    router = Router(config)
    await router.start()
    sock = bind("127.0.0.1", 0)
    server = HttpServer(create_routes(router), config.max_body_bytes)
    await server.listen(sock)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=30) as client:
            yield client
    finally:
        await server.shutdown(1.0)
        await router.close()
        sock.close()


def chat(*urls: str, **fields) -> dict:
    parts = [{"type": "video_url", "video_url": {"url": url}} for url in urls]
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
            "max_tokens": 2, **fields}


def error(response: httpx.Response) -> tuple[int, dict]:
    return response.status_code, response.json()["error"]


def refusal(status: int, message: str, param: str, code: str) -> tuple[int, dict]:
    return status, {"message": message, "type": "invalid_request_error", "param": param, "code": code}


@pytest.fixture
async def video_host() -> AsyncIterator[str]:
    """A host that serves one video as video/webm (host:port)."""
    async def clip(_: web.Request) -> web.Response:
        return web.Response(body=make_video(seed=3), content_type="video/webm")

    async def untyped(_: web.Request) -> web.Response:
        return web.Response(body=make_video(seed=4), content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/clip", clip)
    app.router.add_get("/untyped", untyped)
    async with serving(app) as url:
        yield url.removeprefix("http://")


async def test_colocated_refusals_come_before_any_fan_out_and_a_remote_video_is_fetched(video_host):
    stage = FakeStage("colocated")
    async with serving(stage.app) as url, routed(RouterConfig(colocated=(url,), allowed_image_hosts=(video_host,),
                                                              startup_timeout_s=10)) as client:
        video = data_url(make_video())
        assert error(await client.post(CHAT, json=chat(video, video, video))) == refusal(
            400, "The request has 3 videos; this router accepts at most 2 (--max-videos-per-request).", "messages",
            "too_many_videos")
        assert error(await client.post(CHAT, json=chat(video, "http://evil.example/clip.mp4"))) == refusal(
            400, "Video URLs on host 'evil.example' are not fetched by this router; add it to "
                 "--allowed-image-hosts or send the video as a data: URL.", "messages[0].content[1].video_url",
            "image_host_not_allowed")
        corrupt = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 200).decode()
        status, body = error(await client.post(CHAT, json=chat(corrupt)))
        assert (status, body["code"], body["param"]) == (400, "invalid_video", "messages[0].content[0].video_url")
        assert body["message"].startswith("The data is not a video in a supported container")
        assert error(await client.post(CHAT, json=chat(video, mm_processor_kwargs={"fps": "fast"}))) == refusal(
            400, "Invalid video setting: fps must be a number, got 'fast'", "mm_processor_kwargs.fps", "invalid_value")
        assert error(await client.post(CHAT, json=chat(video, mm_processor_kwargs=[1]))) == refusal(
            400, "Invalid value for 'mm_processor_kwargs': must be an object.", "mm_processor_kwargs", "invalid_value")
        assert stage.chats == []  # no refused request reached the stage
        # an allowed host's video: fetched into a data: URL of its type; mm_processor_kwargs sent on as it is
        answer = await client.post(CHAT, json=chat(f"http://{video_host}/clip", mm_processor_kwargs={"fps": 4}))
        assert answer.status_code == 200, answer.text
        (sent,) = stage.chats
        assert sent["messages"][0]["content"][0] == {"type": "video_url", "video_url": {
            "url": data_url(make_video(seed=3), mime="video/webm")}}
        assert sent["mm_processor_kwargs"] == {"fps": 4}


async def test_a_fetched_video_is_held_to_max_video_mb_and_typed_video_mp4_unless_its_host_says(video_host):
    stage = FakeStage("colocated")
    async with serving(stage.app) as url:
        small = RouterConfig(colocated=(url,), allowed_image_hosts=(video_host,), max_video_mb=1 / 1024,
                             startup_timeout_s=10)
        async with routed(small) as client:
            size = len(make_video(seed=3))
            assert error(await client.post(CHAT, json=chat(f"http://{video_host}/clip"))) == refusal(
                413, f"The video is {size} bytes; this router accepts at most 1024 bytes per video (--max-video-mb).",
                "messages[0].content[0].video_url", "video_too_large")
            assert stage.chats == []
        async with routed(dataclasses.replace(small, max_video_mb=1.0)) as client:
            assert (await client.post(CHAT, json=chat(f"http://{video_host}/untyped"))).status_code == 200
            assert stage.chats[0]["messages"][0]["content"][0]["video_url"]["url"] == data_url(make_video(seed=4))


async def test_the_stages_tighter_video_count_is_theirs_to_name():
    stage = FakeStage("colocated", max_videos=1)
    async with serving(stage.app) as url, routed(RouterConfig(colocated=(url,), startup_timeout_s=10)) as client:
        video = data_url(make_video())
        assert error(await client.post(CHAT, json=chat(video, video))) == refusal(
            400, "The request has 2 videos; the stages behind this router accept at most 1 per request (their "
                 "--max-videos-per-request).", "messages", "too_many_videos")
        assert stage.chats == []
        info = (await client.get("/server_info")).json()
        assert info["limits"]["max_videos_per_request"] == 1 and info["stage_limits"]["max_videos_per_request"] == 1


async def test_a_model_that_takes_no_video_is_named_and_nothing_is_fetched(video_host):
    stage = FakeStage("colocated", video=None)
    async with serving(stage.app) as url, routed(RouterConfig(colocated=(url,), allowed_image_hosts=(video_host,),
                                                              startup_timeout_s=10)) as client:
        for body in (chat(data_url(make_video())), chat(f"http://{video_host}/clip")):
            assert error(await client.post(CHAT, json=body)) == refusal(
                400, "The model m does not take video input.", "messages[0].content[0].video_url",
                "video_not_supported")
        assert stage.chats == []
        assert (await client.post(CHAT, json=chat())).status_code == 200  # text alone is served


async def test_a_stage_that_publishes_no_video_leaves_videos_to_the_stages():
    """No ``video`` in /server_info (an older stage): the router checks nothing of a video, sends it on."""
    stage = FakeStage("colocated", video=UNSET)
    async with serving(stage.app) as url, routed(RouterConfig(colocated=(url,), startup_timeout_s=10)) as client:
        odd = "data:video/mp4;base64,AAAA"
        assert (await client.post(CHAT, json=chat(odd, mm_processor_kwargs={"fps": 1}))).status_code == 200
        assert stage.chats[0]["messages"][0]["content"][0]["video_url"]["url"] == odd


async def test_epd_sends_video_refs_to_the_prefill_and_decode_and_the_video_to_the_encoder(redis_url):  # noqa: F811
    stages = {role: FakeStage(role) for role in ("encoder", "prefill", "decode")}
    async with serving(stages["encoder"].app) as e, serving(stages["prefill"].app) as p, \
            serving(stages["decode"].app) as d, \
            routed(RouterConfig(encoder=(e,), prefill=(p,), decode=(d,), redis_url=redis_url,
                                startup_timeout_s=10)) as client:
        corrupt = "data:video/mp4;base64," + base64.b64encode(b"garbage" * 40).decode()
        status, body = error(await client.post(CHAT, json=chat(corrupt)))
        assert (status, body["code"], body["param"]) == (400, "invalid_video", "messages[0].content[0].video_url")
        assert all(not s.chats and not s.encodes for s in stages.values())
        data = make_video(frames=16)
        answer = await client.post(CHAT, json=chat(data_url(data), mm_processor_kwargs={"num_frames": 8}))
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-epd-cache"] == "hit=0 miss=1"
        sampling = dataclasses.replace(SAMPLING, fps=None, num_frames=8).to_json()
        key = video_key(data, sampling, FP)
        ref = {"type": "video_ref", "video_ref": {"key": key, "probe": {
            "width": 64, "height": 48, "frames": 16, "fps": 8.0, "codec": "h264"}, "sampling": sampling}}
        for role in ("prefill", "decode"):
            (sent,) = stages[role].chats
            assert sent["messages"][0]["content"] == [ref, {"type": "text", "text": "hi"}], role
            assert "mm_processor_kwargs" not in sent
        (encoded,) = stages["encoder"].encodes
        assert encoded["images"] == [{"key": key, "url": data_url(data), "video": sampling}]
        assert encoded["room"] == stages["decode"].chats[0]["bootstrap_room"]
