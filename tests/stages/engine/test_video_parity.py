"""Video in the engine, token for token against Hugging Face generate(): a video alone, a video with an
image, two videos, and a video cut across prefill chunks, for Qwen2-VL, Qwen2.5-VL (absolute-time M-RoPE)
and Qwen3-VL (timestamps in the prompt, deepstack). The frames come the serving way: a real mp4 made with
PyAV, probed, planned (``contract.video``) and only the planned frames decoded (``cache.video_bytes``);
generate() gets the same preprocessed frames as ``pixel_values_videos``. LLaVA's prompt takes no video."""

from __future__ import annotations

import pytest
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from cache.video_bytes import VideoBounds, decode_frames, probe
from contract.video import VideoSampling, plan
from stages.engine.config import EngineConfig
from stages.loading import load_engine
from stages.engine.sampling_params import SamplingParams
from stages.prompt import PromptError
from stages.video_preprocess import VideoFrames
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, load_reference, random_image
from tests.support.videos import make_video

STEPS = 10
BOUNDS = VideoBounds(max_bytes=8 << 20, max_pixels=1 << 22, max_seconds=60, decode_timeout_s=30)
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VIDEO, IMAGE = {"type": "video"}, {"type": "image"}
CASES = {
    "video_alone": [VIDEO, {"type": "text", "text": "What happens in this clip?"}],
    "video_and_image": [IMAGE, {"type": "text", "text": "and"}, VIDEO, {"type": "text", "text": "same place?"}],
    "two_videos": [VIDEO, {"type": "text", "text": "then"}, VIDEO, {"type": "text", "text": "which is longer?"}],
}


def video(sampling: VideoSampling, seed: int, frames: int = 24, container: str = "mp4") -> VideoFrames:
    data = make_video(frames=frames, width=64 + 16 * seed, height=48, fps=8, container=container, seed=seed)
    video_plan = plan(probe(data, BOUNDS), sampling)
    return VideoFrames(decode_frames(data, video_plan.indices, BOUNDS), video_plan)


def items(parts: list[dict], sampling: VideoSampling) -> list:
    found, videos = [], 0
    for part in parts:
        if part is IMAGE:
            found.append(random_image(64, 64, seed=7))
        elif part is VIDEO:
            found.append(video(sampling, seed=videos, frames=24 + 8 * videos, container=("mp4", "webm")[videos]))
            videos += 1
    return found


def run(engine, prompt) -> list[int]:
    request = engine.add_request(f"r{id(prompt)}", prompt, SamplingParams(max_tokens=STEPS, temperature=0.0))
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert engine.allocator.num_used == 0
    return request.output_ids


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = model_dir(request.param)
    whole = load_engine(EngineConfig(model=str(path), kv_cache_mib=32, device=DEVICE, max_batched_tokens=8192), pixels=True)
    chunked = load_engine(EngineConfig(model=str(path), kv_cache_mib=32, device=DEVICE, max_batched_tokens=16,
                                       prefix_caching=False), pixels=True)
    return whole, chunked, load_reference(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_generate(family, case):
    (engine, builder), (chunked, _), reference = family
    prompt = builder.build([{"role": "user", "content": CASES[case]}], items(CASES[case], builder.video.sampling))
    assert prompt.videos and prompt.num_images == len(CASES[case]) - sum(part.get("type") == "text" for part in CASES[case])
    expected = hf_greedy(reference, prompt, engine.adapter.image_token_id, STEPS, engine.adapter.video_token_id)
    assert run(engine, prompt) == expected
    # the same prompt a chunk of 16 tokens per step: every video is cut across chunks
    assert run(chunked, prompt) == expected


def test_qwen3_prompt_writes_transformers_timestamps():
    """Qwen3-VL's prompt (the other families write no timestamps) times each temporal patch as its processor does."""
    engine, builder = load_engine(EngineConfig(model=str(model_dir("qwen3_vl")), kv_cache_mib=8, device=DEVICE),
                                  pixels=True)
    assert engine.adapter.timestamped_video
    clip = video(builder.video.sampling, seed=0, frames=40)
    text = builder.tokenizer.decode(builder.build([{"role": "user", "content": [VIDEO]}], [clip]).token_ids)
    fps = 8.0
    want = Qwen3VLProcessor._calculate_timestamps(None, list(clip.plan.indices), fps, 2)  # the processor's own rule
    assert [f"<{t:.1f} seconds>" for t in want] == [f"<{t:.1f} seconds>" for t in clip.plan.timestamps]
    assert text.count("seconds>") == len(want) == clip.plan.grid[0]


def test_llava_takes_no_video():
    engine, builder = load_engine(EngineConfig(model=str(model_dir("llava")), kv_cache_mib=8, device=DEVICE),
                                  pixels=True)
    assert builder.video is None and engine.adapter.video_token_id is None
    sampling = VideoSampling.from_processor_config("qwen2_vl", {})
    with pytest.raises(PromptError, match="takes no video"):
        builder.build([{"role": "user", "content": [VIDEO]}], [video(sampling, seed=0)])
