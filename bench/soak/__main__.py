"""``python -m bench.soak``: flags, the stack, the run, the JSON, plot and summary (the package's
docstring says what is measured). Exit 1 when the run fails its verdict (no summary then)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common.args import add_model_args, add_output_args, add_server_args, make_parser, output_path, resolve_model
from bench.common.record import Recorder
from bench.overload.stack import add_stack_args, start_pd_stack
from bench.soak import __doc__ as DOC
from bench.soak.report import figures, plot, print_table
from bench.soak.run import run_soak


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.soak")
    add_model_args(p)
    add_stack_args(p, max_num_seqs=64, max_waiting=256, router_in_flight=1024)
    add_soak_args(p)
    add_server_args(p, startup_s=300.0, request_s=120.0)
    add_output_args(p, "soak", quick_help="smoke run: a 60 s hold sampled every 5 s, 5 s ramp steps")
    return p


def add_soak_args(p: argparse.ArgumentParser) -> None:
    """The ramp's, the hold's and the verdict's flags."""
    p.add_argument("--ramp-concurrency", default="1,2,4,8,16", help="the ramp's concurrencies, in order")
    p.add_argument("--ramp-step-s", type=float, default=15.0, help="seconds per ramp step")
    p.add_argument("--load-fraction", type=float, default=0.7, help="the hold's rate over the capacity")
    p.add_argument("--duration-s", type=float, default=1200.0, help="the hold's length")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between /proc samples")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="samples before this are not judged (default: 10%% of the hold)")
    p.add_argument("--max-in-flight", type=int, default=64, help="the client's bound on requests running at once")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    p.add_argument("--rss-growth-mib", type=float, default=32.0, help="RSS growth allowed (or 5%% of RSS, if more)")
    p.add_argument("--fd-growth", type=int, default=32, help="open fds growth allowed per process")
    p.add_argument("--thread-growth", type=int, default=8, help="threads growth allowed per process")


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("soak", build_parser(), argv)
    if args.quick:
        args.duration_s, args.sample_s, args.ramp_step_s = min(args.duration_s, 60.0), min(args.sample_s, 5.0), 5.0
    out = output_path(args)
    model = resolve_model(args)
    stack = start_pd_stack(args, model, out.parent / "soak_logs")
    try:
        report = run_soak(stack, args)
    finally:
        stack.stop()
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "summary_dir")}
    report["config"]["model_dir"] = str(model)
    png = out.with_suffix(".png")
    plot(report, png, f"soak via the router at {args.load_fraction:g} x capacity ({report['capacity_per_s']} req/s), "
                      f"{Path(str(model)).name}, sampled every {args.sample_s:g} s")
    print_table(report)
    ok = report["verdict"]["ok"]
    path = record.finish(out, report, figures(report) if ok else None)
    print(f"wrote {out}, {png}" + (f" and {path}" if path else "") + f" ({record.elapsed_s():.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
