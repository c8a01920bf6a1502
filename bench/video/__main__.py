"""``python -m bench.video``: flags, the phases, the JSON and the summary (the package's docstring says
what is measured)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys

from bench.common.args import (add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder
from bench.video import __doc__ as DOC
from bench.video.analysis import goals, summarize
from bench.video.report import figures, notes, plot, print_table
from bench.video.workload import plan_pairs

FRAMES = (16, 64)
TPOT_FRAMES = (64, 16)
ROLES_PINNED = ("encoder", "prefill", "decode", "colocated", "router", "redis")
QUICK_SIZE = "tiny"


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.video")
    add_model_args(p)
    p.add_argument("--transfer", default="mooncake", help="KV transfer of the epd stack")
    p.add_argument("--systems", default="colocated,epd", help="stacks to run, in order (colocated, epd)")
    p.add_argument("--frames", default=",".join(map(str, FRAMES)),
                   help="mm_processor_kwargs.num_frames to sample (comma-separated)")
    p.add_argument("--video", default="96x320x240@24", help="source videos: FRAMESxWIDTHxHEIGHT@FPS")
    p.add_argument("--requests", type=int, default=5, help="timed miss/hit pairs per frame count and system")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per video request")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request")
    p.add_argument("--no-encoder", action="store_true", help="skip the encoder's frames/s (epd)")
    p.add_argument("--encoder-frames", type=int, default=64, help="frames sampled per video sent to the encoder")
    p.add_argument("--encoder-batch", type=int, default=4, help="videos sent to the encoder at once, batched part")
    p.add_argument("--encoder-trials", type=int, default=3, help="rounds of each encoder part")
    p.add_argument("--tpot-trials", type=int, default=3, help="stream trials alone and with a video (each); 0 skips")
    p.add_argument("--stream-tokens", type=int, default=200, help="tokens of the long text stream")
    p.add_argument("--arrive-after", type=int, default=20, help="stream tokens before the video request is sent")
    p.add_argument("--tpot-frames", default=",".join(map(str, TPOT_FRAMES)),
                   help="frames sampled of the video sent beside the stream (comma-separated, one trial each per "
                        "round; the first is the headline and the goal's, the rest how the stall scales)")
    add_cores_args(p, {"encoder": ("1", "the encoder"), "prefill": ("1", "the prefill"), "decode": ("0", "the decode"),
                       "colocated": ("1", "the colocated server"), "router": ("", "the router"),
                       "redis": ("", "the embedded Redis"), "client": ("", "this process, the client")})
    add_server_args(p, startup_s=300.0, request_s=180.0)
    add_output_args(p, "video", quick_help=f"smoke run: the {QUICK_SIZE} model (unless --size/--model-dir say "
                    "otherwise), 2 pairs per frame count, 1 round of each encoder part, 1 stream trial of 60 tokens")
    return p


def parse_video(text: str) -> tuple[int, int, int, int]:
    """``FRAMESxWIDTHxHEIGHT@FPS`` -> (frames, width, height, fps)."""
    shape, _, fps = text.partition("@")
    frames, width, height = (int(v) for v in shape.split("x"))
    return frames, width, height, int(fps or 24)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, record = Recorder.start("video", parser, argv)
    if args.quick:
        if args.size == parser.get_default("size") and not args.model_dir:
            args.size = QUICK_SIZE
        args.requests, args.encoder_trials = min(args.requests, 2), min(args.encoder_trials, 1)
        args.tpot_trials, args.stream_tokens = min(args.tpot_trials, 1), min(args.stream_tokens, 60)
    frames = [int(n) for n in args.frames.split(",") if n.strip()]
    modes = [m.strip() for m in args.systems.split(",") if m.strip()]
    args.video_shape = parse_video(args.video)
    args.tpot_frames = [int(n) for n in str(args.tpot_frames).split(",") if n.strip()]
    cores = {role: parse_cores(getattr(args, f"{role}_cores")) for role in ROLES_PINNED}
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    model = resolve_model(args)
    print(f"model {model}; client pid {os.getpid()} on cores {client_cores or 'any'}; load {loadavg()}", flush=True)
    from bench.video.phase import run_phase

    first_seed = random.getrandbits(30)
    pairs = plan_pairs(frames, args.requests, first_seed)  # the same videos and questions for every system
    seeds = itertools.count(first_seed + 1_000_000)
    runs = {}
    for mode in modes:
        print(f"--- {mode}", flush=True)
        runs[mode] = run_phase(mode, args, model, pairs, seeds, out, cores)
    summary = summarize(runs, frames)
    f, w, h, fps = args.video_shape
    report = {
        "benchmark": "video",
        "pinning": {**{role: c or None for role, c in cores.items()},
                    "client": {"pid": os.getpid(), "cores": client_cores or None}, "torch_threads": args.threads},
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "systems": modes,
                   "frames": frames, "video": {"frames": f, "width": w, "height": h, "fps": fps, "container": "mp4"},
                   "requests": args.requests, "max_tokens": args.max_tokens, "gap_s": args.gap_s,
                   "transfer": args.transfer, "encoder": {"frames": args.encoder_frames, "batch": args.encoder_batch,
                                                          "trials": args.encoder_trials},
                   "stream": {"tokens": args.stream_tokens, "trials": args.tpot_trials,
                              "arrive_after": args.arrive_after, "video_frames": args.tpot_frames},
                   "quick": args.quick, "driven_through": "router", "first_seed": first_seed,
                   "ttft": "send -> first SSE chunk with non-empty delta content, through the router",
                   "hit": "the same video bytes with a different question written before the video: the prefix "
                          "cache can reuse only the template's head; epd's embedding cache holds the video "
                          "(the goal is judged on it)",
                   "follow_up_hit": "the video first, then a different question about the same video bytes: the "
                                    "prefix cache covers the video's span as well (embedding + prefix cache); its "
                                    "miss is the same layout with a new video"},
        "summary": summary,
        "goals": goals(summary),
        "runs": runs,
    }
    png = out.with_suffix(".png")
    plot(summary, runs, frames, png, f"video, {args.family}-{args.size}, {f} frames {w}x{h}@{fps} mp4 sources, via "
                                     f"the router; E core {args.encoder_cores}, P core {args.prefill_cores}, D core "
                                     f"{args.decode_cores}, colocated core {args.colocated_cores}")
    print_table(summary, frames)
    print(f"goals: {json.dumps(report['goals'])}")
    report["notes"] = notes(summary, args)
    for line in report["notes"]:
        print(f"note: {line}")
    path = record.finish(out, report, figures(summary, frames))
    if path is not None:  # the summary's notes: the pinning, the goal's hit, the TPOT explanation
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "notes": report["notes"]}, indent=2) + "\n")
    print(f"wrote {out}, {png} and {path} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
