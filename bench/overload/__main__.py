"""``python -m bench.overload``: flags, the stack, the run, the JSON, plot and summary (the package's
docstring says what is measured). Exit 1 when the run fails its verdict (no summary then)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common.args import add_model_args, add_output_args, add_server_args, make_parser, output_path, resolve_model
from bench.common.record import Recorder
from bench.overload import __doc__ as DOC
from bench.overload.report import figures, plot, print_table
from bench.overload.run import run_overload
from bench.overload.stack import add_stack_args, start_pd_stack


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.overload")
    add_model_args(p)
    add_stack_args(p, max_num_seqs=4, max_waiting=8, router_in_flight=256)
    p.add_argument("--clients", type=int, default=500, help="concurrent clients")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per answer")
    p.add_argument("--deadline-s", type=float, default=180.0, help="the whole burst's deadline")
    p.add_argument("--sample-s", type=float, default=0.5, help="seconds between /proc samples")
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0, help="peak RSS growth allowed per process")
    add_server_args(p, startup_s=300.0, request_s=120.0)
    add_output_args(p, "overload", quick_help="smoke run: 100 clients, 1 request each")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("overload", build_parser(), argv)
    if args.quick:
        args.clients, args.requests_per_client = min(args.clients, 100), 1
    out = output_path(args)
    model = resolve_model(args)
    stack = start_pd_stack(args, model, out.parent / "overload_logs")
    try:
        report = run_overload(stack, args)
    finally:
        stack.stop()
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "summary_dir")}
    report["config"]["model_dir"] = str(model)
    png = out.with_suffix(".png")
    plot(report, png, f"overload via the router: {args.clients} clients x {args.requests_per_client}, "
                      f"{Path(str(model)).name}, P/D --max-num-seqs {args.max_num_seqs} "
                      f"--max-waiting {args.max_waiting}")
    print_table(report)
    ok = report["verdict"]["ok"]
    path = record.finish(out, report, figures(report) if ok else None)
    print(f"wrote {out}, {png}" + (f" and {path}" if path else "") + f" ({record.elapsed_s():.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
