"""``python -m bench.fleet_scale``: flags, the in-process measures per size, the live router per size,
the table, the JSON and the summary (the package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import sys

from bench.common.args import add_cores_args, add_output_args, make_parser, output_path
from bench.common.pinning import pin_this_process
from bench.common.record import Recorder
from bench.fleet_scale import __doc__ as DOC
from bench.fleet_scale.inproc import hot_path, planner
from bench.fleet_scale.live import measure
from bench.fleet_scale.report import figures, table


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.fleet_scale")
    p.add_argument("--sizes", default="8,64,256", help="workers per role, comma-separated")
    p.add_argument("--repeats", type=int, default=400, help="timed calls per in-process measure (bounded by time too)")
    p.add_argument("--budget-s", type=float, default=6.0, help="seconds at most per in-process measure group and size")
    p.add_argument("--live", action=argparse.BooleanOptionalAction, default=True, help="also the router process against the fake fleet")
    p.add_argument("--requests", type=int, default=600, help="requests per traffic phase")
    p.add_argument("--concurrency", type=int, default=16, help="the second traffic phase's concurrency")
    p.add_argument("--phase-max-s", type=float, default=120.0, help="a traffic phase is cut at this many seconds")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds the router's idle CPU is read over")
    p.add_argument("--settle-s", type=float, default=6.0, help="seconds after the router is healthy before measuring")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds the router may take to be healthy")
    add_cores_args(p, {"router": ("1", "the router"), "fleet": ("0", "the fake fleet"),
                       "client": ("0", "this process (the client)")})
    add_output_args(p, "fleet_scale", quick_help="smoke run: sizes 8,64, fewer repeats and requests, 5 s idle")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("fleet_scale", build_parser(), argv)
    if args.quick:
        args.sizes, args.repeats, args.requests, args.idle_s, args.budget_s = "8,64", 100, 150, 5.0, 2.0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out = output_path(args)
    pin_this_process(args.client_cores)
    plan, hot, live = {}, {}, {}
    for n in sizes:
        plan[n], hot[n] = planner(n, args.repeats, args.budget_s), hot_path(n, args.repeats, args.budget_s)
        print(f"N={n}: decision {plan[n]['decision']}, plan rr {hot[n]['plan_round_robin']}", flush=True)
    if args.live:
        for n in sizes:
            live[n] = measure(n, args, out)
            print(f"N={n}: idle {live[n]['idle']}, phases "
                  f"{ {k: (v['cpu_ms'], v['net_cpu_ms'], v['error_count']) for k, v in live[n]['phases'].items()} }",
                  flush=True)
    text = table(plan, hot, live, args.concurrency)
    print("\n" + text)
    failed = [f"N={n} {k}: {v['error_count']} errors, e.g. {v['errors'][:1]}" for n, lv in live.items()
              for k, v in lv["phases"].items() if v["error_count"] or not v["answered"]]
    report = {"benchmark": "fleet_scale", "config": {k: v for k, v in vars(args).items()}, "planner": plan,
              "hot_path": hot, "live": live, "table": text, "failed": failed}
    if failed:
        record.finish(out, report, None)
        print("FAILED (no summary written):\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    summary = record.finish(out, report, figures(plan, hot, live, args.concurrency))
    print(f"wrote {out} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
