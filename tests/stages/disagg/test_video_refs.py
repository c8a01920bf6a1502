"""An EPD prefill's video references (``ImageInputs.fill`` with a ``VideoRef``: key, probe, sampling): the
entry must fit the video's plan (``plan.num_tokens`` rows, grid ``plan.grid``), beside image references in
order; the errors say "video" and name the key in ``image_key``. A fake cache, no Redis."""

from __future__ import annotations

import pytest
import torch

from cache.entry import Entry, InRedis
from cache.errors import NotPending
from cache.store import CachedEmbedding
from contract.video import VideoProbe, VideoSampling
from stages.api.message_schemas import ImageRef, VideoRef
from stages.disagg.embeddings import EmbeddingShape, ImageInputs
from stages.disagg.errors import DisaggError
from stages.engine.multimodal import Prompt

pytestmark = pytest.mark.unit

IMAGE_KEY, VIDEO_KEY, OTHER_KEY = "aa" * 32, "bb" * 32, "cc" * 32
SAMPLING = VideoSampling.from_processor_config("qwen2_vl", {"num_frames": 8, "min_pixels": 1, "max_pixels": 10**6})
PROBE = VideoProbe(width=56, height=56, frames=16, fps=8.0, codec="h264")


class Prompts:
    """The size rule of a Qwen2-VL-like model: 56 x 56 -> 4 tokens, grid (1, 4, 4)."""

    def num_image_tokens(self, width: int, height: int) -> int:
        return 4

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        return (1, 4, 4)


class Cache:
    def __init__(self, entries: dict[str, tuple[int, list[int]]]) -> None:
        self.entries = entries
        self.deleted: list[str] = []

    async def get(self, key: str) -> CachedEmbedding | None:
        if key not in self.entries:
            return None
        tokens, grid = self.entries[key]
        entry = Entry(key, [], tokens, grid, 0, "enc", 0.0, 0.0, InRedis())
        return CachedEmbedding(entry, {"embeds": torch.full((tokens, 8), float(len(grid) + tokens))})

    async def wait_ready(self, key: str, deadline_s: float) -> CachedEmbedding:
        raise NotPending(key)

    async def delete(self, key: str) -> bool:
        self.deleted.append(key)
        return True


def video_ref(key: str = VIDEO_KEY, **sampling: object) -> VideoRef:
    return VideoRef(key=key, probe=PROBE.to_json(), sampling={**SAMPLING.to_json(), **sampling})


def inputs(cache: Cache) -> ImageInputs:
    shape = EmbeddingShape(hidden_size=8, deepstack_layers=0)
    return ImageInputs(cache, shape, Prompts(), 1.0)  # type: ignore[arg-type]


async def test_video_and_image_references_fill_the_prompt_in_order():
    video_plan = video_ref().plan()
    assert video_plan.grid == (4, 4, 4) and video_plan.num_tokens == 16
    cache = Cache({IMAGE_KEY: (4, [1, 4, 4]), VIDEO_KEY: (16, [4, 4, 4])})
    prompt = Prompt(token_ids=[1, 2, 3])
    image = ImageRef(key=IMAGE_KEY, width=56, height=56)
    await inputs(cache).fill(prompt, [(video_ref(), "messages[0].content[0]"), (image, "messages[0].content[1]"),
                                      (video_ref(), "messages[0].content[2]")])
    assert [(e.num_tokens, e.grid_thw) for e in prompt.embeddings] == [(16, (4, 4, 4)), (4, (1, 4, 4)),
                                                                        (16, (4, 4, 4))]
    assert cache.deleted == []


async def test_a_video_entry_that_does_not_fit_its_plan_is_dropped_and_named():
    cache = Cache({VIDEO_KEY: (16, [8, 2, 4])})  # 16 rows, but another grid
    with pytest.raises(DisaggError) as failed:
        await inputs(cache).fill(Prompt(token_ids=[1]), [(video_ref(), "messages[0].content[0]")])
    error = failed.value
    assert (error.status, error.code, error.param, error.image_key) == (502, "embedding_mismatch",
                                                                        "messages[0].content[0]", VIDEO_KEY)
    assert str(error).startswith(f"The cached embedding of video {VIDEO_KEY} does not fit this request: the entry's "
                                 "image grid is [8, 2, 4], the reference's size gives [4, 4, 4]")
    assert "probe and sampling" in str(error) and cache.deleted == [VIDEO_KEY]


async def test_a_video_not_cached_is_named_a_video():
    with pytest.raises(DisaggError) as failed:
        await inputs(Cache({})).fill(Prompt(token_ids=[1]), [(video_ref(), "messages[0].content[0]")])
    error = failed.value
    assert (error.status, error.code, error.param, error.image_key) == (400, "image_not_cached",
                                                                        "messages[0].content[0].key", VIDEO_KEY)
    assert str(error).startswith(f"Video {VIDEO_KEY} is not in the embedding cache")


async def test_a_video_reference_without_a_plan_is_refused_before_any_read():
    cache = Cache({VIDEO_KEY: (16, [4, 4, 4])})
    too_many = video_ref(num_frames=32)  # the probe has 16 frames
    with pytest.raises(DisaggError) as failed:
        await inputs(cache).fill(Prompt(token_ids=[1]), [(too_many, "messages[0].content[0]")])
    assert (failed.value.status, failed.value.code, failed.value.image_key) == (400, "invalid_video", VIDEO_KEY)
    assert "32 frames asked for; the video has 16" in str(failed.value)
