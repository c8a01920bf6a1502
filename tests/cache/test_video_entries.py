"""A video's entry in the embedding cache: one key (``cache.keys.video_key``) for the whole video, many times an
image's bytes. What it weighs (rows x hidden x dtype bytes, times 1 + deepstack layers, plus its metadata),
that it evicts as many least-recently-used entries as it needs, and that one over the budget is refused
with nothing changed. Real redis-server."""

from __future__ import annotations

import pytest
import torch

from cache.errors import EntryTooLarge
from cache.keys import image_key, video_key
from cache.store import EmbeddingCache
from contract.video import VideoSampling
from tests.support.redis_fixtures import make_config, redis_server, redis_url  # noqa: F401

FP = "ab" * 32
HIDDEN, LAYERS = 64, 3  # a tiny Qwen3-VL: embeds [tokens, 64], deepstack [3, tokens, 64]
IMAGE_GRID, VIDEO_GRID = [1, 8, 8], [32, 8, 8]  # an image's 16 tokens; 64 frames = 32 temporal patches of 16


def tensors(seed: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embeds": torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16),
            "deepstack": torch.randn(LAYERS, tokens, HIDDEN, generator=gen).to(torch.bfloat16)}


def tokens_of(grid: list[int]) -> int:
    return grid[0] * grid[1] * grid[2] // 4  # merge 2 x 2


def image(n: int) -> str:
    return image_key(f"image-{n}".encode(), FP)


def video(n: int) -> str:
    sampling = VideoSampling.from_processor_config("qwen3_vl", {"num_frames": 64}).to_json()
    return video_key(f"video-{n}".encode(), sampling, FP)


async def test_a_video_entry_weighs_its_rows_and_evicts_what_it_needs(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as probe:
        entry = await probe.put(image(0), tensors(0, 16), num_tokens=16, image_grid=IMAGE_GRID, encoder="e")
        image_bytes = await probe.stored_bytes()
        await probe.delete(image(0))
        video_tokens = tokens_of(VIDEO_GRID)
        big = await probe.put(video(0), tensors(1, video_tokens), num_tokens=video_tokens, image_grid=VIDEO_GRID,
                              encoder="e")
        video_bytes = await probe.stored_bytes()
        await probe.delete(video(0))
    assert entry.payload_bytes == 16 * HIDDEN * 2 * (1 + LAYERS)
    assert big.payload_bytes == video_tokens * HIDDEN * 2 * (1 + LAYERS) == 32 * entry.payload_bytes
    assert video_bytes > 30 * image_bytes

    budget = video_bytes + 3 * image_bytes + image_bytes // 2  # one video and three images, not four
    async with EmbeddingCache(make_config(redis_url, budget_bytes=budget)) as cache:
        for n in range(1, 7):
            await cache.put(image(n), tensors(n, 16), num_tokens=16, image_grid=IMAGE_GRID, encoder="e")
        assert await cache.get(image(1)) is not None  # image 2 is the oldest now
        evictions = cache.stats().evictions
        await cache.put(video(1), tensors(100, video_tokens), num_tokens=video_tokens, image_grid=VIDEO_GRID,
                        encoder="e")
        assert await cache.stored_bytes() <= budget
        assert cache.stats().evictions - evictions >= 3
        present = await cache.contains_many([image(n) for n in range(1, 7)] + [video(1)])
        assert video(1) in present and len(present) <= 4 and image(2) not in present
        hit = await cache.get(video(1))
        assert hit is not None and hit.entry.image_grid == VIDEO_GRID and hit.entry.num_tokens == video_tokens
        assert torch.equal(hit.tensors["deepstack"], tensors(100, video_tokens)["deepstack"])

        before = await cache.stored_bytes()
        longer = [2 * VIDEO_GRID[0], *VIDEO_GRID[1:]]  # 128 frames: over the whole budget
        with pytest.raises(EntryTooLarge, match="does not fit in the cache budget"):
            await cache.put(video(2), tensors(200, tokens_of(longer)), num_tokens=tokens_of(longer),
                            image_grid=longer, encoder="e")
        assert await cache.stored_bytes() == before
        assert video(1) in await cache.contains_many([video(1), video(2)])


async def test_an_entry_over_redis_largest_value_is_refused_before_any_write(redis_url: str, monkeypatch) -> None:
    """Redis takes no value over proto-max-bulk-len (512 MB): such an entry is EntryTooLarge naming the cause,
    before any write (here with the bound lowered, so the test moves kilobytes, not half a gigabyte)."""
    from cache import store

    monkeypatch.setattr(store, "MAX_VALUE_BYTES", 4096)
    async with EmbeddingCache(make_config(redis_url)) as cache:
        with pytest.raises(EntryTooLarge, match="proto-max-bulk-len"):
            await cache.put(video(9), tensors(9, 64), num_tokens=64, image_grid=[4, 8, 8], encoder="e")
        assert await cache.get(video(9)) is None and await cache.stored_bytes() == 0
