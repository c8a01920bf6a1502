"""A video's sampling plan: which of its frames the vision tower sees, at what size, and the placeholder
tokens and timing that follow. Pure and torch-free.

Who calls: the router (EPD: a video's cache key and the reference it sends the prefill and the
decode), every stage that takes a video (the prompt's placeholder count, the frames to decode and
preprocess) and the encoder. All of them compute the same ``VideoPlan`` from the same ``VideoProbe``
(read from the file by ``cache.video_bytes``) and the same ``VideoSampling`` (the checkpoint's video
processor config, the server's ``--mm-processor-kwargs``, then the request's ``mm_processor_kwargs``,
each within the server's limits), so a plan never has to travel: its inputs do.

The rules are transformers' video processors', written out (they need torchvision, which cannot be
installed beside a CPU torch):

    rule "qwen2_vl" (Qwen2-VL, Qwen2.5-VL; ``Qwen2VLVideoProcessor``): sample ``fps`` frames a second,
        clamped to [min_frames, max_frames] and the video's frames and floored to a multiple of the
        temporal patch; frame i of n is ``floor(i * total / n)``. Each frame resized by ``smart_resize``
        within [min_pixels, max_pixels] (``cap_pixels_per_frame``: max_pixels also capped at an even share
        of ``max_video_tokens`` tokens' pixels).
    rule "qwen3_vl" (Qwen3-VL; ``Qwen3VLVideoProcessor``): ``int(total / fps_video * fps)`` frames clamped
        the same way (not floored), spread by ``linspace(0, total - 1, n).round()``; the pixel budget
        [min_pixels, max_pixels] is over all sampled frames together (t x h x w).

One decision differs from transformers: Qwen2-VL's processor samples nothing by default
(``do_sample_frames=False``: the caller samples). Here sampling always happens, at the config's ``fps``
or 2.0 (qwen-vl-utils' default) where the config names none, so a long video never reaches the tower
whole.

Timing: ``seconds_per_grid`` (Qwen2.5-VL's absolute-time M-RoPE: temporal patch / sampled fps) and
``timestamps`` (Qwen3-VL's ``<t seconds>`` text before each temporal patch: the mean time of its frames).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

RULES = ("qwen2_vl", "qwen3_vl")
DEFAULT_FPS = 2.0
MAX_REQUEST_FPS = 60
MAX_ASPECT_RATIO = 200
# The keys a request's (and a server's) mm_processor_kwargs may set, vLLM's names for the Qwen video processors.
OVERRIDABLE = ("fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels")


class VideoSettingError(ValueError):
    """A video setting refused (``with_overrides``, ``within``): ``key`` names it (None: the settings
    together, e.g. min_frames over max_frames)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(message)
        self.key = key


class VideoPlanError(ValueError):
    """The video cannot be sampled under these settings (too few frames, an aspect ratio over 200, ...);
    the message says why, for a 400."""


@dataclass(frozen=True)
class VideoProbe:
    """What a video file says about itself before any frame is decoded (``cache.video_bytes.probe``):
    its first video stream's size, frame count (packets counted), average frame rate and codec."""

    width: int
    height: int
    frames: int
    fps: float
    codec: str

    @property
    def duration_s(self) -> float:
        return self.frames / self.fps

    def to_json(self) -> dict:
        return {"width": self.width, "height": self.height, "frames": self.frames, "fps": self.fps,
                "codec": self.codec}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VideoProbe:
        """ValueError for anything but the fields ``to_json`` writes, with their types."""
        probe = cls(**_typed(cls, data))
        if min(probe.width, probe.height, probe.frames) <= 0 or not probe.fps > 0:
            raise ValueError(f"a video probe needs a positive size, frame count and fps, got {dict(data)}")
        return probe


@dataclass(frozen=True)
class VideoSampling:
    """Everything that decides a video's frames and their size: the rule, the sampling settings and the
    vision tower's patch geometry. Built by ``from_processor_config``, then ``with_overrides``."""

    rule: str
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    cap_pixels_per_frame: bool = False
    max_video_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"video sampling rule {self.rule!r} is not one of {RULES}")
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("fps and num_frames are mutually exclusive: set one of them")
        if self.fps is not None and not (0 < self.fps <= 1000):
            raise ValueError(f"fps must be in (0, 1000], got {self.fps}")
        for name in ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "patch_size",
                     "temporal_patch_size", "merge_size", "max_video_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) is more than max_frames ({self.max_frames})")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is more than max_pixels ({self.max_pixels})")

    @classmethod
    def from_processor_config(cls, rule: str, config: Mapping[str, Any]) -> VideoSampling:
        """From a checkpoint's ``video_preprocessor_config.json`` (or its ``preprocessor_config.json``,
        which the Qwen2-VL checkpoints ship alone): ``size`` {shortest_edge, longest_edge} or
        min_pixels/max_pixels, the frame settings, the patch geometry. Defaults are the rule's
        processor class's."""
        defaults = _RULE_DEFAULTS[rule]
        size: Mapping[str, Any] = config["size"] if isinstance(config.get("size"), Mapping) else {}
        value = {**defaults, **{k: config[k] for k in defaults if config.get(k) is not None}}
        fps = config.get("fps")
        num_frames = config.get("num_frames")
        return cls(
            rule=rule,
            fps=None if num_frames is not None else float(fps) if fps is not None else DEFAULT_FPS,
            num_frames=int(num_frames) if num_frames is not None else None,
            min_frames=int(value["min_frames"]), max_frames=int(value["max_frames"]),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or value["min_pixels"]),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or value["max_pixels"]),
            patch_size=int(value["patch_size"]), temporal_patch_size=int(value["temporal_patch_size"]),
            merge_size=int(value["merge_size"]),
            cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(config["max_video_tokens"]) if config.get("max_video_tokens") else None,
        )

    def with_overrides(self, overrides: Mapping[str, Any]) -> VideoSampling:
        """These settings with ``overrides`` (keys of ``OVERRIDABLE``; ``fps`` and ``num_frames`` replace
        each other). VideoSettingError naming the key for an unknown key, a wrong type or a bad value."""
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in OVERRIDABLE:
                raise VideoSettingError(key, f"unknown video setting {key!r}; the settings are {', '.join(OVERRIDABLE)}")
            if key == "fps":
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise VideoSettingError(key, f"fps must be a number, got {value!r}")
                changes.update(fps=float(value), num_frames=None)
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise VideoSettingError(key, f"{key} must be an integer, got {value!r}")
                changes[key] = value
                if key == "num_frames":
                    changes["fps"] = None
        try:
            return replace(self, **changes)
        except ValueError as exc:
            keys = [key for key in overrides if key in str(exc)]
            raise VideoSettingError(keys[0] if len(keys) == 1 else None, str(exc)) from None

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VideoSampling:
        return cls(**_typed(cls, data))

    @property
    def factor(self) -> int:
        """Frame sides are multiples of this (a merged patch)."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VideoPlan:
    """The frames to decode (``indices``, ascending), the size each is resized to, the vision tower's
    grid (temporal patches, patch rows, patch columns), and the timing the prompt and M-RoPE need."""

    indices: tuple[int, ...]
    height: int
    width: int
    grid: tuple[int, int, int]
    merge_size: int
    seconds_per_grid: float
    timestamps: tuple[float, ...]

    @property
    def frame_tokens(self) -> int:
        """Placeholder tokens of one temporal patch (a Qwen3-VL prompt writes them frame by frame)."""
        return self.grid[1] * self.grid[2] // self.merge_size**2

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.frame_tokens


def within(base: VideoSampling, overrides: Mapping[str, Any]) -> VideoSampling:
    """A request's sampling: the server's ``base`` with the request's ``mm_processor_kwargs`` video keys,
    none past the server's own bounds (``num_frames`` and ``max_frames`` at most ``base.max_frames``,
    ``max_pixels`` at most ``base.max_pixels``, ``fps`` at most 60). VideoSettingError naming the key."""
    sampling = base.with_overrides(overrides)
    for key, most in (("num_frames", base.max_frames), ("max_frames", base.max_frames),
                      ("max_pixels", base.max_pixels), ("fps", MAX_REQUEST_FPS)):
        value = overrides.get(key)
        if value is not None and value > most:
            raise VideoSettingError(key, f"{key} is {value}; this server samples at most {most}")
    return sampling


def check_resolved(base: VideoSampling, sampling: VideoSampling, holder: str = "server") -> None:
    """That ``sampling`` (resolved elsewhere: a video_ref's, an encode's) is one ``within(base, ...)`` could
    have made: every setting but ``OVERRIDABLE`` is ``base``'s, and those within its bounds.
    VideoSettingError naming the key."""
    for f in fields(VideoSampling):
        if f.name not in OVERRIDABLE and getattr(sampling, f.name) != getattr(base, f.name):
            raise VideoSettingError(f.name, f"{f.name} is {getattr(sampling, f.name)!r}; this {holder}'s model has "
                                    f"{getattr(base, f.name)!r}")
    within(base, {key: value for key in OVERRIDABLE if (value := getattr(sampling, key)) is not None})


def plan(probe: VideoProbe, sampling: VideoSampling) -> VideoPlan:
    """The plan of a video under ``sampling``; VideoPlanError if it cannot be sampled."""
    indices = _indices(probe, sampling)
    tps = sampling.temporal_patch_size
    if len(indices) < tps:
        raise VideoPlanError(f"the video has {probe.frames} frames; {len(indices)} would be sampled, fewer than "
                             f"the {tps} frames one temporal patch of this model takes")
    height, width = _resize(probe, sampling, len(indices))
    grid_t = -(-len(indices) // tps)
    grid = (grid_t, height // sampling.patch_size, width // sampling.patch_size)
    sampled_fps = len(indices) / probe.frames * probe.fps
    padded = list(indices) + [indices[-1]] * (grid_t * tps - len(indices))
    times = [i / probe.fps for i in padded]
    timestamps = tuple((times[k] + times[k + tps - 1]) / 2 for k in range(0, len(times), tps))
    return VideoPlan(tuple(indices), height, width, grid, sampling.merge_size, tps / sampled_fps, timestamps)


def _indices(probe: VideoProbe, s: VideoSampling) -> list[int]:
    total = probe.frames
    if s.rule == "qwen3_vl":
        if s.num_frames is not None:
            n = s.num_frames
        elif s.fps is not None:
            n = min(max(int(total / probe.fps * s.fps), s.min_frames), s.max_frames, total)
        else:
            n = min(max(total, s.min_frames), s.max_frames)
        if n > total:
            raise VideoPlanError(f"{n} frames asked for; the video has {total}")
        return [round(v) for v in _linspace(0, total - 1, n)]
    tps = s.temporal_patch_size
    if s.num_frames is not None:
        n = round(s.num_frames / tps) * tps
    elif s.fps is not None:
        most = math.floor(min(s.max_frames, total) / tps) * tps
        n = math.floor(min(max(total / probe.fps * s.fps, s.min_frames), most, total) / tps) * tps
    else:
        n = total
    if n > total:
        raise VideoPlanError(f"{n} frames asked for; the video has {total}")
    return [int(i * total / n) for i in range(n)]


def _linspace(start: float, stop: float, n: int) -> list[float]:
    """numpy's ``linspace(start, stop, n)``: ``start + i * step``, the last exactly ``stop``."""
    if n == 1:
        return [start]
    step = (stop - start) / (n - 1)
    return [start + i * step for i in range(n - 1)] + [stop]


def _resize(probe: VideoProbe, s: VideoSampling, frames: int) -> tuple[int, int]:
    height, width, factor = probe.height, probe.width, s.factor
    if s.rule == "qwen3_vl":
        max_pixels = s.max_pixels
        if s.cap_pixels_per_frame:
            cap = (s.max_video_tokens or 768) * factor * factor
            max_pixels = max(min(cap, s.max_pixels // frames), int(s.min_pixels * 1.05)) * frames
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        _check_aspect(height, width)
        return _smart_resize(height, width, factor, frames, s.min_pixels, max_pixels)
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:
        total = int((s.max_video_tokens or 128000) * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total * s.temporal_patch_size // frames), int(s.min_pixels * 1.05))
    _check_aspect(height, width)
    return _smart_resize(height, width, factor, 1, s.min_pixels, max_pixels)


def _smart_resize(height: int, width: int, factor: int, frames: int, min_pixels: int,
                  max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of ``factor`` with ``frames`` x h x w within the pixel bounds, the aspect
    ratio kept as near as can be (transformers' ``smart_resize``; ``frames`` 1: per frame)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoPlanError(f"the video's aspect ratio ({width}x{height}) is over {MAX_ASPECT_RATIO}:1")


def _typed(cls: type, data: Mapping[str, Any]) -> dict:
    """``data``'s fields of dataclass ``cls``, exactly; ValueError for a missing or unknown one."""
    names = {f.name for f in fields(cls)}
    if not isinstance(data, Mapping) or set(data) - names:
        raise ValueError(f"not a {cls.__name__}: {data!r:.200}")
    return dict(data)


# The processor classes' own defaults (transformers 5.25), for a config that leaves a key out.
_RULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"min_frames": 4, "max_frames": 768, "min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28,
                 "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
    "qwen3_vl": {"min_frames": 4, "max_frames": 768, "min_pixels": 128 * 32 * 32, "max_pixels": 768 * 32 * 32,
                 "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2},
}
