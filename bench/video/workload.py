"""The workload: distinct generated videos (new bytes per seed), the chat bodies (one video and a
question, ``mm_processor_kwargs.num_frames``), the long text-only stream and the encoder's
``/v1/encode`` body. Pure but the video encoding (PyAV, imported late).

A video is ``frames`` frames of ``width`` x ``height`` at ``fps``, H.264 in MP4 (MPEG-4 Part 2 where
this FFmpeg has no libx264), every frame different (a gradient moving across, a square of a seeded
colour at a seeded place: the idea of tests/support/videos.py, which a bench may not import); two seeds
give different bytes, so a new seed is a video no stack has seen."""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

QUESTIONS = ("Describe this video.", "What happens in this clip?", "Which colours move across the frames?",
             "Summarise the scene in one line.", "What is the square doing?", "Name the main object shown.",
             "How does the picture change over time?", "Is the motion left to right?", "Describe the background.",
             "What stays the same in every frame?", "Count the shapes you see.", "Where is the square at the end?")
STREAM_PROMPT = "Write a long story about a lighthouse keeper who counts the ships that pass at night."


def _codec() -> str:
    import av

    try:
        av.codec.Codec("libx264", "w")
    except av.error.FFmpegError:
        return "mpeg4"
    return "h264"


def make_video(seed: int, frames: int = 96, width: int = 320, height: int = 240, fps: int = 24) -> bytes:
    """An MP4 of ``frames`` frames (yuv420p, even sides); different bytes for every ``seed``."""
    import av
    import numpy

    rng = numpy.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream(_codec(), rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if stream.codec_context.name == "libx264":
            stream.codec_context.options = {"preset": "ultrafast"}
        x = numpy.arange(width) * 255 // max(width - 1, 1)
        y = numpy.arange(height) * 255 // max(height - 1, 1)
        side = max(2, min(width, height) // 4)
        colour = rng.integers(0, 256, 3, dtype=numpy.uint8)
        for index in range(frames):
            pixels = numpy.empty((height, width, 3), numpy.uint8)
            pixels[..., 0] = ((x + index * 23) % 256)[None, :]
            pixels[..., 1] = y[:, None]
            pixels[..., 2] = (index * 37 + seed) % 256
            top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
            pixels[top:top + side, left:left + side] = colour
            output.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def data_url(video: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video).decode()


def chat_body(video: bytes, question: str, num_frames: int, max_tokens: int, stream: bool = True,
              video_first: bool = False) -> dict:
    """One user turn of a question and a video sampled at ``num_frames`` frames (``mm_processor_kwargs``).
    By default the question first, so a different question differs before the video's placeholders and
    the prefix cache cannot reuse the video's KV; ``video_first``: the video then the question (a
    follow-up about the same video shares the prompt up to the question: the prefix cache covers the
    video's span)."""
    parts = [{"type": "text", "text": question}, {"type": "video_url", "video_url": {"url": data_url(video)}}]
    content = parts[::-1] if video_first else parts
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "mm_processor_kwargs": {"num_frames": num_frames}}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def stream_body(max_tokens: int) -> dict:
    """The long text-only streamed completion whose token gaps are measured (``ignore_eos``: all ``max_tokens``)."""
    return {"messages": [{"role": "user", "content": STREAM_PROMPT}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def encode_body(room: int, video: bytes, sampling: dict) -> dict:
    """The encoder's ``POST /v1/encode`` of one video (key left to the encoder) with its resolved sampling."""
    return {"room": room, "images": [{"data": base64.b64encode(video).decode(), "video": sampling}]}


EMBEDDING, FOLLOW_UP = "embedding", "follow_up"
KINDS = (EMBEDDING, FOLLOW_UP)
# a pair's two requests by kind: the cases the samples and the summary are keyed by
CASES = {EMBEDDING: ("miss", "hit"), FOLLOW_UP: ("follow_up_miss", "follow_up_hit")}
LABELS = {"miss": "miss", "hit": "hit (embedding cache only)",
          "follow_up_miss": "follow-up miss (video first, a new video)",
          "follow_up_hit": "follow-up hit (embedding + prefix cache)"}


@dataclass(frozen=True)
class Pair:
    """A miss (a video never sent before, ``questions[0]``) then a hit (the same bytes, ``questions[1]``).
    ``kind`` ``embedding``: the question before the video, so a hit's prompt differs before the video and
    only the embedding cache can hit; ``follow_up``: the video before the question (a second question
    about the same video), so the hit's prefix cache also covers the video's span."""

    frames: int  # mm_processor_kwargs.num_frames
    index: int  # 0.. timed; -1 the warm-up
    seed: int
    questions: tuple[str, str]
    kind: str = EMBEDDING

    @property
    def cases(self) -> tuple[str, str]:
        return CASES[self.kind]


def plan_pairs(frame_counts: list[int], requests: int, first_seed: int, kinds=KINDS) -> list[Pair]:
    """The warm-up pair of each frame count and kind, then ``requests`` pairs per count and kind, counts
    and kinds interleaved; every pair its own seed (a new video), and its two questions different."""
    rng = random.Random(first_seed)
    pairs, seed = [], first_seed
    for index in [-1, *range(requests)]:
        for frames in frame_counts:
            for kind in kinds:
                a, b = rng.sample(QUESTIONS, 2)
                pairs.append(Pair(frames, index, seed, (a, b), kind))
                seed += 1
    return pairs
