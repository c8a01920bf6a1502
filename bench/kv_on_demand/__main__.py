"""``python -m bench.kv_on_demand``: flags, both modes, the JSON, the plot and the summary (the
package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import sys

from bench.common.args import add_model_args, add_output_args, make_parser, output_path, resolve_model
from bench.common.machine import loadavg
from bench.common.record import Recorder
from bench.kv_on_demand import __doc__ as DOC
from bench.kv_on_demand.report import figures, plot, print_table, ratios
from bench.kv_on_demand.run import output_lengths, run_mode

MODES = ("on_demand", "reserve")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.kv_on_demand")
    add_model_args(p)
    p.add_argument("--kv-cache-mib", type=int, default=64, help="the one pool both modes get (small: 8 KiB a token)")
    p.add_argument("--requests", type=int, default=128, help="requests added at once (also --max-num-seqs)")
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of every request")
    p.add_argument("--output-tokens", type=int, default=64, help="mean output length (each +- 25%%, seeded)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    add_output_args(p, "kv_on_demand", quick_help="smoke run: 48 requests")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("kv_on_demand", build_parser(), argv)
    if args.quick:
        args.requests = min(args.requests, 48)
    out, model = output_path(args), resolve_model(args)
    lengths = output_lengths(args.requests, args.output_tokens)
    print(f"model {model}; {args.requests} requests, max_tokens {args.max_tokens}, outputs {min(lengths)}-"
          f"{max(lengths)} tokens; pool {args.kv_cache_mib} MiB; load {loadavg()}", flush=True)
    runs = []
    for mode in MODES:
        runs.append(run_mode(str(model), mode, args.kv_cache_mib, lengths, args.max_tokens, args.threads))
        print(f"{mode}: {runs[-1]['seconds']:.1f} s, most running {runs[-1]['max_running']}", flush=True)
    on_demand, reserve = runs
    same = on_demand.pop("outputs") == reserve.pop("outputs")
    ratio = ratios(on_demand, reserve)
    report = {"benchmark": "kv_on_demand",
              "config": {"family": args.family, "size": args.size, "model_dir": str(model),
                         "kv_cache_mib": args.kv_cache_mib, "requests": args.requests, "max_tokens": args.max_tokens,
                         "output_tokens": lengths, "threads": args.threads, "quick": args.quick, "temperature": 0,
                         "ignore_eos": True, "end": "the engine aborts a request at its output length"},
              "runs": runs, "ratios": ratio, "same_tokens": same}
    png = out.with_suffix(".png")
    plot(runs, png, f"{args.requests} requests at once, max_tokens {args.max_tokens}, ~{args.output_tokens} output "
                    f"tokens; one {args.kv_cache_mib} MiB pool ({on_demand['pool_blocks']} blocks), "
                    f"{args.family}-{args.size}")
    print_table(runs, ratio, same)
    summary = record.finish(out, report, figures(on_demand, reserve, ratio, same))
    print(f"wrote {out}, {png} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
