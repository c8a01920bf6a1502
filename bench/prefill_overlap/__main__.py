"""``python -m bench.prefill_overlap``: flags, the rounds of phases, the JSON and the summary (the
package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time

from bench.common.args import (add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder
from bench.prefill_overlap import __doc__ as DOC
from bench.prefill_overlap.analysis import summarize_all
from bench.prefill_overlap.client import measure
from bench.prefill_overlap.report import figures, plot, print_table
from bench.prefill_overlap.stack import SYSTEMS, start_system
from bench.prefill_overlap.workload import Bodies, plan_round, system_text

ROLES = ("encoder", "prefill", "decode", "colocated")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.prefill_overlap")
    add_model_args(p)
    p.add_argument("--transfer", default="mooncake", help="KV transfer of the EPD stacks")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems to run")
    p.add_argument("--images", default="1,2,4", help="images per request (comma-separated)")
    p.add_argument("--image-size", type=int, default=616, help="width and height of every image (pixels)")
    p.add_argument("--system-tokens", type=int, default=1000, help="prompt tokens of the system prompt and question")
    p.add_argument("--requests", type=int, default=5, help="timed requests per image count, system and round")
    p.add_argument("--rounds", type=int, default=2, help="run the sequence of systems this many times (pooled)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request")
    add_cores_args(p, {"encoder": ("0", "the encoder"), "prefill": ("1", "the prefill"), "decode": ("0", "the decode"),
                       "colocated": ("1", "the colocated server"), "client": ("", "this process, the client")})
    add_server_args(p, startup_s=300.0, request_s=120.0)
    add_output_args(p, "prefill_overlap", quick_help="smoke run: 2 requests per image count, 1 round")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("prefill_overlap", build_parser(), argv)
    if args.quick:
        args.requests, args.rounds = min(args.requests, 2), 1
    counts = [int(n) for n in args.images.split(",") if n.strip()]
    systems = [s for s in args.systems.split(",") if s.strip()]
    cores = {role: parse_cores(getattr(args, f"{role}_cores")) for role in ROLES}
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    model = resolve_model(args)
    text, tokens = system_text(model, args.system_tokens)
    bodies = Bodies(text, args.image_size, args.max_tokens)
    print(f"model {model}; system prompt + question {tokens} tokens; client pid {os.getpid()} on cores "
          f"{client_cores or 'any'}; load {loadavg()}", flush=True)
    samples: dict[str, list[dict]] = {s: [] for s in systems}
    runs: list[dict] = []
    for round_index in range(1, args.rounds + 1):
        plan = plan_round(counts, args.requests, round_index)  # the same bodies for every system
        for name in systems:
            print(f"--- round {round_index}/{args.rounds}: {name}", flush=True)
            log_dir = out.with_name(f"{out.stem}_{name}_r{round_index}")
            shutil.rmtree(log_dir, ignore_errors=True)
            started = time.perf_counter()
            system = start_system(name, args, model, log_dir, cores)
            try:
                startup_s = time.perf_counter() - started
                print(f"[{name}] healthy after {startup_s:.1f} s; load {loadavg()}", flush=True)
                got = asyncio.run(measure(system, bodies, plan, args))
            finally:
                system.stop()
            samples[name] += got
            runs.append({"system": name, "round": round_index, "startup_s": round(startup_s, 1),
                         "pinning": system.pins(), "loadavg_1m": loadavg()})
            for n in counts:
                ttft = sorted(1e3 * s["ttft_s"] for s in got if s["n"] == n and not s["warmup"])
                print(f"[{name}] {n} images: TTFT {', '.join(f'{t:.0f}' for t in ttft)} ms", flush=True)
    summary = summarize_all(samples, counts)
    report = {
        "benchmark": "prefill_overlap",
        "pinning": {**{role: c or None for role, c in cores.items()},
                    "client": {"pid": os.getpid(), "cores": client_cores or None}, "torch_threads": args.threads,
                    "note": "router and Redis not pinned; every thread of a server pinned once healthy"},
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "images": counts,
                   "image_size": args.image_size, "system_prompt_tokens": tokens, "requests": args.requests,
                   "rounds": args.rounds, "max_tokens": args.max_tokens, "gap_s": args.gap_s,
                   "transfer": args.transfer, "systems": systems, "quick": args.quick,
                   "driven_through": "stage serve router (colocated: router --colocated)",
                   "cache": "miss: every request's system prompt starts with its own number, every image is new",
                   "ttft": "send -> first SSE chunk with non-empty delta content, through the router"},
        "summary": summary,
        "runs": runs,
        "samples": samples,
    }
    png = out.with_suffix(".png")
    plot(summary, counts, png, f"prefill overlap, {args.family}-{args.size}, ~{tokens}-token system prompt + "
                               f"{args.image_size}px images, via the router; E core {args.encoder_cores}, P core "
                               f"{args.prefill_cores}, D core {args.decode_cores}, colocated core {args.colocated_cores}")
    print_table(summary, counts)
    print(f"goals met: {json.dumps(summary['goals_met'])}")
    path = record.finish(out, report, figures(summary, counts))
    print(f"wrote {out}, {png} and {path} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
