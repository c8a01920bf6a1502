"""Video chats for the stack tests and Hugging Face's answer to them: ``chat(kinds)`` builds the OpenAI
messages of a conversation of videos (``"video"``, ``"video2"``: two real clips, mp4 and webm) and images
(``"image"``) then a question, sampled with ``KWARGS`` (a request's ``mm_processor_kwargs``);
``reference(variant, kinds)`` is generate()'s greedy answer on the very frames a server samples (the
checkpoint's sampling under the default ``--mm-processor-kwargs`` and ``--max-video-frames``, then
``KWARGS``), decoded the serving way (``cache.video_bytes``), with the tokenizer to read it."""

from __future__ import annotations

import functools
import io

import torch
from PIL import Image

from cache.video_bytes import VideoBounds, decode_frames, probe
from contract.video import plan, within
from stages.api.videos import server_sampling
from stages.config import VideoLimits
from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from stages.video_preprocess import VideoFrames
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy
from tests.support.stage_api import data_url as png_data_url
from tests.support.stage_api import png
from tests.support.videos import data_url, make_video

BOUNDS = VideoBounds(max_bytes=8 << 20, max_pixels=1 << 22, max_seconds=60, decode_timeout_s=30)
CLIPS = {"video": (make_video(frames=24, width=80, height=48, fps=8, container="mp4", seed=3), "video/mp4"),
         "video2": (make_video(frames=40, width=64, height=64, fps=10, container="webm", seed=4), "video/webm")}
IMAGE = png(64, 64)
KWARGS = {"num_frames": 8}
QUESTION = "what moves?"


def chat(kinds: tuple[str, ...], question: str = QUESTION) -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": png_data_url(IMAGE)}} if kind == "image" else
                         {"type": "video_url", "video_url": {"url": data_url(*CLIPS[kind])}} for kind in kinds]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


@functools.cache
def _loaded(variant: str) -> tuple:
    path = model_dir(variant)
    adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)
    return adapter, PromptBuilder.load(path, adapter)


def reference(variant: str, kinds: tuple[str, ...], steps: int) -> tuple[list[int], str]:
    """generate()'s greedy tokens for ``chat(kinds)``, and their text."""
    adapter, builder = _loaded(variant)
    sampling = within(server_sampling(builder.video.sampling, VideoLimits()), KWARGS)
    items: list = []
    for kind in kinds:
        if kind == "image":
            items.append(Image.open(io.BytesIO(IMAGE)))
            continue
        clip = CLIPS[kind][0]
        video_plan = plan(probe(clip, BOUNDS), sampling)
        items.append(VideoFrames(decode_frames(clip, video_plan.indices, BOUNDS), video_plan))
    parts = [{"type": "image" if kind == "image" else "video"} for kind in kinds]
    prompt = builder.build([{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}], items)
    tokens = hf_greedy(adapter.model, prompt, adapter.image_token_id, steps, adapter.video_token_id)
    return tokens, builder.tokenizer.decode(tokens, skip_special_tokens=True)
