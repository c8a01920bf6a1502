"""What a stage process holds, for ``/server_info``: the parameters it loaded, its resident memory and
the limits it enforces on a request."""

from __future__ import annotations

import os
from typing import Any

from process.instance import instance_id


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_info(adapter: Any, images: str) -> dict:
    """The ``/server_info`` fields every model-running role reports: the halves it loaded
    (``adapter.parts``), their parameter count, how it takes images, its resident memory now, and this
    process's start id (``process.instance``)."""
    return {"parts": list(adapter.parts), "num_parameters": adapter.num_parameters, "images": images,
            "rss_bytes": rss_bytes(), "instance_id": instance_id()}


def engine_info(engine: Any) -> dict:
    """``/server_info`` ``engine`` of a role with a KV pool (``engine``: its ``AsyncEngine``): the dtype of
    the weights and the pool and where it came from (``--dtype``, or what ``auto`` chose:
    ``stages.engine.dtype_choice``), and the pool's blocks and bytes and where its size came from
    (``--kv-cache-mib``, the CPU default or ``--gpu-memory-utilization``: ``stages.engine.kv_sizing``)."""
    layout, sizing = engine.layout, engine.kv_sizing
    return {"dtype": engine.dtype.name, "dtype_source": engine.dtype.source,
            "kv_pool": {"blocks": layout.num_blocks, "block_size": layout.block_size, "block_bytes": layout.block_bytes,
                        "bytes": sizing.bytes, "source": sizing.source}}


def limits_info(config: Any, max_model_len: int | None = None, chars_per_token: int | None = None) -> dict:
    """``/server_info`` ``limits`` of a stage (``config``: its ``ServerConfig``): what it refuses a request
    for before any work. A router reads them and refuses such a request itself, before any fan-out.
    A stage that takes text adds its context (``max_model_len`` tokens) and its tokenizer's
    ``chars_per_token`` (``stages.text_bound``; None: no such bound), from which a text's least
    token count follows."""
    limits = {"max_body_bytes": config.max_body_bytes, "max_images_per_request": config.limits.max_images,
              "max_image_bytes": config.limits.max_bytes, "max_image_pixels": config.limits.max_pixels,
              "max_videos_per_request": config.video.max_videos, "max_in_flight": config.max_in_flight}
    if max_model_len is not None:
        limits |= {"max_model_len": max_model_len, "chars_per_token": chars_per_token}
    return limits


def video_info(sampling: Any, limits: Any) -> dict | None:
    """``/server_info`` ``video`` of a stage whose model takes video (None: it takes none): the sampling
    every video starts from (``stages.api.videos.server_sampling``: ``contract.video.VideoSampling``, as
    JSON) and the limits of one video (``limits``: its ``VideoLimits``). The router plans, keys and refuses
    videos with exactly these before any fan-out."""
    if sampling is None:
        return None
    return {"sampling": sampling.to_json(), "max_bytes": limits.max_bytes, "max_pixels": limits.max_pixels,
            "max_seconds": limits.max_seconds, "max_frames": limits.max_frames,
            "decode_timeout_s": limits.decode_timeout_s}
