"""``python -m bench.epd_cache``: flags, the rounds of phases, the JSON and the summary (the
package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from bench.common.args import (add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder
from bench.epd_cache import __doc__ as DOC
from bench.epd_cache.analysis import goals, same_texts, summarize
from bench.epd_cache.phase import run_phase
from bench.epd_cache.report import figures, plot, print_phase, print_table
from bench.epd_cache.workload import ImageSource, plan_round

IMAGE_COUNTS = (1, 4, 8)
ROLES_PINNED = ("encoder", "prefill", "decode", "colocated", "router", "redis")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.epd_cache")
    add_model_args(p)
    p.add_argument("--transfer", default="mooncake", help="KV transfer of the epd stack")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated phase")
    p.add_argument("--images", default=",".join(map(str, IMAGE_COUNTS)), help="images per request (comma-separated)")
    p.add_argument("--image-size", type=int, default=224, help="width and height of every image (pixels)")
    p.add_argument("--requests", type=int, default=4, help="timed miss/hit pairs per image count, phase and round")
    p.add_argument("--rounds", type=int, default=2, help="run the sequence of phases this many times (pooled)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request")
    p.add_argument("--burst-requests", type=int, default=32, help="requests of the concurrent burst (epd, per round)")
    p.add_argument("--burst-concurrency", type=int, default=8, help="requests in flight in the burst")
    p.add_argument("--burst-unique", type=int, default=12, help="distinct images the burst's requests draw from")
    p.add_argument("--seed", type=int, default=0, help="the burst's image choice")
    add_cores_args(p, {"encoder": ("0", "the encoder"), "prefill": ("1", "the prefill"), "decode": ("0", "the decode"),
                       "colocated": ("1", "the colocated server"), "router": ("", "the router"),
                       "redis": ("", "the embedded Redis"), "client": ("", "this process, the client")})
    add_server_args(p, startup_s=300.0, request_s=120.0)
    add_output_args(p, "epd_cache", quick_help="smoke run: 2 pairs per image count, 1 round, a 16-request burst")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("epd_cache", build_parser(), argv)
    if args.quick:
        args.requests, args.rounds, args.burst_requests = min(args.requests, 2), 1, min(args.burst_requests, 16)
    counts = [int(n) for n in args.images.split(",") if n.strip()]
    cores = {role: parse_cores(getattr(args, f"{role}_cores")) for role in ROLES_PINNED}
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    model = resolve_model(args)
    print(f"model {model}; client pid {os.getpid()} on cores {client_cores or 'any'}; load {loadavg()}", flush=True)
    source = ImageSource(args.image_size, random.getrandbits(32))
    modes = ([] if args.no_colocated else ["colocated"]) + ["epd"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for round_index in range(1, args.rounds + 1):
        pairs = plan_round(source, counts, args.requests, round_index)  # the same bodies for every system
        for mode in modes:
            print(f"--- round {round_index}/{args.rounds}: {mode}", flush=True)
            runs[mode].append(run_phase(mode, args, model, pairs, source, out, round_index, cores))
            print_phase(runs[mode][-1], counts)
    summary = summarize(runs, counts)
    summary["same_text_as_colocated"] = same_texts(runs)
    report = {
        "benchmark": "epd_cache",
        "pinning": {**{role: c or None for role, c in cores.items()},
                    "client": {"pid": os.getpid(), "cores": client_cores or None}, "torch_threads": args.threads,
                    "note": "every thread of a process pinned once healthy; pids per phase under runs[].pinning"},
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "images": counts,
                   "image_size": args.image_size, "requests": args.requests, "rounds": args.rounds,
                   "max_tokens": args.max_tokens, "gap_s": args.gap_s, "transfer": args.transfer,
                   "burst": {"requests": args.burst_requests, "concurrency": args.burst_concurrency,
                             "unique": args.burst_unique}, "quick": args.quick, "driven_through": "router",
                   "ttft": "send -> first SSE chunk with non-empty delta content, through the router",
                   "wake": "prefill room event embeddings_ready - the last image's landing: the kernel's receive "
                           "stamp of its ready event on a subscriber socket (upper bound: - its entry's "
                           "created_at); misses whose prefill waited"},
        "summary": summary,
        "goals": goals(summary),
        "runs": runs,
    }
    png = out.with_suffix(".png")
    plot(summary, runs, counts, png, f"epd cache, {args.family}-{args.size}, {args.image_size}px images, 1 request at "
                                     f"a time via the router; E core {args.encoder_cores}, P core {args.prefill_cores}"
                                     f", D core {args.decode_cores}, colocated core {args.colocated_cores}")
    print_table(summary, counts)
    print(f"goals: {json.dumps(report['goals'])}")
    path = record.finish(out, report, figures(summary, counts))
    print(f"wrote {out}, {png} and {path} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
