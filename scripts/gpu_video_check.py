"""scripts/gpu-check.sh's video-processor check: our video preprocessing (``contract.video`` sampling and
``stages.video_preprocess``, written over torch alone because transformers' video processors need
torchvision, which cannot be installed beside a CPU torch) against transformers' own Qwen video
processors, where torchvision imports (a CUDA torch from PyPI and PyPI's torchvision).

For each Qwen family's generated checkpoint and three source videos (sizes and lengths that exercise
the resize bounds and the frame clamps): the sampled indices (``sample_frames`` with the file's frame
count and fps) and then ``pixel_values_videos`` and ``video_grid_thw`` of the processor given the very
frames we sample, against ours; then the whole processor (``AutoProcessor``: it samples the full video
itself, writes Qwen3-VL's timestamps, expands the placeholders) against our prompt builder's token ids
and pixels. Fails unless indices, grids and token ids are equal and the pixels agree within
``TOLERANCE``. Prints one line. Without torchvision it exits 3 saying so (gpu-check.sh: "skipped").

Run once on the CPU (2026-12-07) with PyPI's torchvision 0.28 imported by hand beside the CPU torch (its
fake-kernel registrations emptied, which the resize does not use): everything equal, pixels exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contract.video import VideoProbe, plan  # noqa: E402
from stages.engine.config import EngineConfig  # noqa: E402
from stages.launch.models import cache_dir  # noqa: E402
from stages.loading import load_engine  # noqa: E402
from stages.modelgen import make_model  # noqa: E402
from stages.video_preprocess import VideoConfig, VideoFrames, preprocess_video  # noqa: E402

TOLERANCE = 1e-5  # both resize the same uint8 frames with the same torch kernel; only float order may differ
SOURCES = [(48, 320, 240, 24.0), (9, 64, 48, 8.0), (300, 1280, 720, 30.0)]  # frames, width, height, fps
RULES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    try:
        import torchvision  # noqa: F401
        from transformers import AutoProcessor, AutoVideoProcessor
        from transformers.video_utils import VideoMetadata
    except Exception as exc:  # torchvision absent, or its ops do not load beside this torch
        print(f"skipped: transformers' video processors need torchvision here ({type(exc).__name__}: {exc})")
        return 3
    worst, checked = 0.0, 0
    for family, rule in RULES.items():
        path = cache_dir() / f"video-check-{family}"
        if not path.exists():
            make_model(family=family, size="tiny", out=path, seed=0)
        ours = VideoConfig.load(path, rule)
        theirs = AutoVideoProcessor.from_pretrained(path)
        for frames, width, height, fps in SOURCES:
            probe = VideoProbe(width, height, frames, fps, "h264")
            video_plan = plan(probe, ours.sampling)
            metadata = VideoMetadata(total_num_frames=frames, fps=fps, width=width, height=height)
            indices = [int(i) for i in theirs.sample_frames(metadata)]
            if indices != list(video_plan.indices):
                print(f"FAILED {family} {frames}x{width}x{height}@{fps}: indices {indices} != ours {video_plan.indices}")
                return 1
            rng = np.random.default_rng(frames)
            decoded = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in video_plan.indices]
            out = theirs(videos=[np.stack(decoded)], do_sample_frames=False, return_tensors="pt")
            mine = preprocess_video(decoded, video_plan, ours)
            grid = tuple(int(v) for v in out["video_grid_thw"][0])
            if grid != mine.grid_thw or out["pixel_values_videos"].shape != mine.pixel_values.shape:
                print(f"FAILED {family} {frames}x{width}x{height}: grid {grid} != ours {mine.grid_thw}")
                return 1
            worst = max(worst, float((out["pixel_values_videos"].float() - mine.pixel_values).abs().max()))
            checked += 1
        if not _whole_processor_agrees(path, AutoProcessor.from_pretrained(path), VideoMetadata):
            return 1
    verdict = "passed" if worst <= TOLERANCE else "FAILED"
    print(f"{verdict}: {checked} videos over 3 families, indices, grids and prompts equal, pixels within {worst:.2e} "
          f"(tolerance {TOLERANCE:g})")
    return 0 if verdict == "passed" else 1


def _whole_processor_agrees(path: Path, processor, metadata_cls) -> bool:
    """transformers' processor on a whole 40-frame video (it samples) against our prompt builder."""
    _, builder = load_engine(EngineConfig(model=str(path), kv_cache_mib=8, device="cpu"), pixels=True)
    frames, width, height, fps = 40, 96, 64, 10.0
    video = np.random.default_rng(1).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    video_plan = plan(VideoProbe(width, height, frames, fps, "h264"), builder.video.sampling)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what?"}]}]
    ours = builder.build(messages, [VideoFrames([video[i] for i in video_plan.indices], video_plan)])
    out = processor(text=[builder.render(messages)], videos=[video], return_tensors="pt", do_sample_frames=True,
                    video_metadata=[metadata_cls(total_num_frames=frames, fps=fps, width=width, height=height)])
    if out["input_ids"][0].tolist() != ours.token_ids or not (out["pixel_values_videos"] == ours.images[0].pixel_values).all():
        print(f"FAILED {path.name}: the processor's token ids or pixels differ from our prompt's")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
