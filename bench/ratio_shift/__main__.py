"""``python -m bench.ratio_shift``: flags, the fleet, one router per configuration, the JSON and the
summary (the package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time

from bench.common.args import add_model_args, add_output_args, make_parser, output_path, resolve_model
from bench.common.machine import loadavg
from bench.common.record import Recorder
from bench.ratio_shift import __doc__ as DOC
from bench.ratio_shift.analysis import goals, summarize
from bench.ratio_shift.report import figures, plot, print_table
from bench.ratio_shift.workload import IMAGES, TEXT, plan_phases

QUICK_SIZE = "tiny"
GOAL = 1.3
AUTO = {"auto-pd": ("prefill,decode", "never"), "auto-epd": ("encoder,prefill,decode", "never"),
        "auto-epd-local": ("encoder,prefill,decode", "auto")}
JUDGED = ("auto-epd", "auto-epd-local")
WORKER_ARGS = ("--kv-cache-mib", "256", "--max-batch-images", "4")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.ratio_shift")
    add_model_args(p)
    p.add_argument("--workers", type=int, default=4, help="switchable EPD workers (stage serve pd --redis-url)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every worker")
    p.add_argument("--fixed", default="2:1:1,1:2:1", help="fixed E:P:D splits tried for the best fixed one")
    p.add_argument("--autos", default=",".join(AUTO), help="auto configurations run after the fixed splits")
    p.add_argument("--phases", default=f"{IMAGES},{TEXT},{IMAGES}", help="the load's phases in order")
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase")
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients")
    p.add_argument("--image-size", type=int, default=448, help="side of each (square) image, pixels")
    p.add_argument("--prompt-words", type=int, default=400, help="words of a text-only prompt")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens generated per request (ignore_eos)")
    p.add_argument("--slo-factor", type=float, default=2.0, help="SLO = this x the best fixed split's medians")
    p.add_argument("--auto-interval-s", type=float, default=2.0, help="the router's --auto-ratio-interval-s")
    p.add_argument("--ratio-window-s", type=float, default=8.0, help="the router's --ratio-window-s")
    p.add_argument("--sample-s", type=float, default=1.0, help="GET /admin/workers this often")
    p.add_argument("--worker-arg", action="append", default=None,
                   help=f"flag for every worker (repeat; replaces {' '.join(WORKER_ARGS)} when given)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    add_output_args(p, "ratio_shift", quick_help=f"smoke run: the {QUICK_SIZE} model (unless --size/--model-dir "
                    "say otherwise), 10 s phases, the first fixed split only")
    return p


def parse_split(text: str) -> dict[str, int]:
    """``E:P:D`` -> {"encoder": E, "prefill": P, "decode": D}."""
    e, p, d = (int(n) for n in text.split(":"))
    return {"encoder": e, "prefill": p, "decode": d}


def router_flags(name: str, args: argparse.Namespace) -> list[str]:
    """The router's flags of configuration ``name`` (``fixed-E:P:D`` or one of ``AUTO``)."""
    common = ["--drain-timeout-s", "60", "--ratio-window-s", str(args.ratio_window_s)]
    if name.startswith("fixed-"):
        return [*common, "--auto-ratio-interval-s", "0", "--local-encode", "never"]
    roles, local = AUTO[name]
    return [*common, "--auto-ratio-interval-s", str(args.auto_interval_s), "--auto-ratio-roles", roles,
            "--local-encode", local]


def run_config(fleet, name: str, split: dict[str, int], args: argparse.Namespace, phases, serials) -> dict:
    from bench.ratio_shift.client import drive

    fleet.flush()
    flags = router_flags(name, args)
    router = fleet.start_router(split, flags, name, args.startup_timeout)
    print(f"--- {name}: start {split}, router {' '.join(flags)}; load {loadavg()}", flush=True)
    try:
        started = time.perf_counter()
        requests, samples = asyncio.run(drive(router.url, phases, args, serials))
        wall = time.perf_counter() - started
    finally:
        fleet.stop_router()
    failed = sum(not r["ok"] for r in requests)
    print(f"    {len(requests)} requests, {failed} failed, {wall:.0f} s; load {loadavg()}", flush=True)
    return {"start_split": split, "router_flags": flags, "wall_s": round(wall, 1), "requests": requests,
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, record = Recorder.start("ratio_shift", parser, argv)
    fixed = [f"fixed-{s.strip()}" for s in args.fixed.split(",") if s.strip()]
    autos = [a.strip() for a in args.autos.split(",") if a.strip()]
    if args.quick:
        if args.size == parser.get_default("size") and not args.model_dir:
            args.size = QUICK_SIZE
        args.phase_s, fixed = min(args.phase_s, 10.0), fixed[:1]
    args.worker_arg = args.worker_arg or list(WORKER_ARGS)
    phases = plan_phases([k.strip() for k in args.phases.split(",")], args.phase_s)
    out = output_path(args)
    model = resolve_model(args)
    from bench.ratio_shift.fleet import Fleet

    fleet = Fleet(model, args.workers, args.threads, out.with_name(f"{out.stem}_logs"),
                  [*args.worker_arg, "--log-level", "warning"])
    serials = itertools.count(random.getrandbits(24) * 1000)
    runs: dict[str, dict] = {}
    try:
        fleet.wait(args.startup_timeout)
        print(f"model {model}; {args.workers} workers up; load {loadavg()}", flush=True)
        for name in fixed:
            runs[name] = run_config(fleet, name, parse_split(name.removeprefix("fixed-")), args, phases, serials)
        best = summarize(runs, fixed, phases, args.slo_factor).get("best_fixed", fixed[0])
        for name in autos:
            runs[name] = run_config(fleet, name, runs[best]["start_split"], args, phases, serials)
    finally:
        fleet.stop()
    summary = summarize(runs, fixed, phases, args.slo_factor)
    report = {"benchmark": "ratio_shift",
              "config": {"family": args.family, "size": args.size, "model_dir": str(model), "workers": args.workers,
                         "threads": args.threads, "fixed": fixed, "autos": autos, "clients": args.clients,
                         "phases": [vars(p) for p in phases], "image_size": args.image_size,
                         "images_per_request": "3 or 4, alternating", "prompt_words": args.prompt_words,
                         "max_tokens": args.max_tokens, "slo_factor": args.slo_factor,
                         "auto_interval_s": args.auto_interval_s, "ratio_window_s": args.ratio_window_s,
                         "worker_args": args.worker_arg, "quick": args.quick},
              "summary": summary, "goals": goals(summary, JUDGED, GOAL), "runs": runs}
    png = out.with_suffix(".png")
    plot(runs, phases, summary, png, f"ratio_shift, {args.family}-{args.size}, {args.workers} switchable workers, "
                                     f"{args.clients} clients, {args.image_size}px images")
    print_table(summary, phases)
    print(f"goals: {json.dumps(report['goals'])}")
    path = record.finish(out, report, figures(summary, phases, JUDGED))
    print(f"wrote {out}, {png} and {path} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
