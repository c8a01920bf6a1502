"""``python -m bench.prefix_cache``: flags, the rounds of phases, the JSON and the summary (the
package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import json
import sys

from bench.common.args import add_model_args, add_output_args, add_server_args, make_parser, output_path, resolve_model
from bench.common.machine import loadavg
from bench.common.record import Recorder
from bench.prefix_cache import __doc__ as DOC
from bench.prefix_cache.analysis import summarize
from bench.prefix_cache.phase import run_phase
from bench.prefix_cache.report import figures, plot, print_table
from bench.prefix_cache.workload import TURNS

MODES = ("colocated", "epd")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.prefix_cache")
    add_model_args(p)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated stacks (colocated, epd)")
    p.add_argument("--transfer", default="mooncake", help="KV transfer of the epd stack")
    p.add_argument("--image-size", type=int, default=448, help="width and height of the image (pixels)")
    p.add_argument("--conversations", type=int, default=4, help="timed conversations per phase and round")
    p.add_argument("--turns", type=int, default=TURNS, help=f"turns per conversation (at most {TURNS})")
    p.add_argument("--rounds", type=int, default=2, help="run the sequence of phases this many times (pooled)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request")
    add_server_args(p, startup_s=300.0, request_s=120.0)
    add_output_args(p, "prefix_cache", quick_help="smoke run: 1 conversation per phase")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("prefix_cache", build_parser(), argv)
    if args.quick:
        args.conversations, args.rounds = 1, 1
    modes = [m for m in args.modes.split(",") if m.strip()]
    out = output_path(args)
    model = resolve_model(args)
    print(f"model {model}; load {loadavg()}", flush=True)
    phases = []
    for round_index in range(1, args.rounds + 1):
        for mode in modes:
            for caching in (True, False) if round_index % 2 else (False, True):  # each order once in two rounds
                print(f"--- round {round_index}/{args.rounds}: {mode}, prefix caching {'on' if caching else 'off'}",
                      flush=True)
                phases.append(run_phase(mode, caching, args, model, out, round_index))
    summary = summarize(phases)
    report = {
        "benchmark": "prefix_cache",
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "modes": modes,
                   "image_size": args.image_size, "conversations": args.conversations, "turns": args.turns,
                   "rounds": args.rounds, "max_tokens": args.max_tokens, "gap_s": args.gap_s,
                   "transfer": args.transfer, "torch_threads": args.threads, "quick": args.quick,
                   "driven_through": "router", "pinning": "none: every process on any core",
                   "ttft": "send -> first SSE chunk with non-empty delta content, through the router"},
        "summary": summary,
        "phases": phases,
    }
    png = out.with_suffix(".png")
    plot(summary, png, f"prefix caching, {args.family}-{args.size}, one {args.image_size}px image, {args.turns}-turn chat, "
                       f"1 request at a time via the router, {args.threads} torch thread(s)")
    print_table(summary)
    print(f"goals: {json.dumps({m: s['goal_met'] for m, s in summary.items()})}")
    checked = all(s["same_texts"] for s in summary.values())
    if not checked:
        print("prefix caching on and off answered differently: no summary written", flush=True)
    path = record.finish(out, report, figures(summary) if checked else None)
    print(f"wrote {out}, {png} and {path} ({record.elapsed_s():.0f} s)")
    return 0 if checked else 1


if __name__ == "__main__":
    sys.exit(main())
