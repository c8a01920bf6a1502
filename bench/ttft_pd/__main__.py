"""``python -m bench.ttft_pd``: flags, the rounds of phases, the JSON and the summary (the package's
docstring says what is measured)."""

from __future__ import annotations

import argparse
import os
import sys

from bench.common.args import (add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder
from bench.ttft_pd import __doc__ as DOC
from bench.ttft_pd.analysis import cache_problems, merge_runs, ratios_vs_colocated
from bench.ttft_pd.phase import run_phase
from bench.ttft_pd.report import figures, plot, print_breakdown, print_table
from bench.ttft_pd.workload import CACHE, LONG_TOKENS, WORKLOADS, Bodies, long_text, system
from process.ports import free_port
from transfer.registry import BACKENDS


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.ttft_pd")
    add_model_args(p)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated transfer backends ('' : none)")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated phase")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--long-tokens", type=int, default=LONG_TOKENS, help="prompt tokens of text_2k")
    p.add_argument("--requests", type=int, default=6, help="timed requests per workload, phase and round")
    p.add_argument("--rounds", type=int, default=2, help="run the sequence of phases this many times (samples pooled)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request (low load: the servers "
                   "have finished the previous one)")
    add_cores_args(p, {"colocated": ("1", "the colocated server"), "prefill": ("0", "the prefill server"),
                       "decode": ("1", "the decode server"), "client": ("", "this process (the client)")})
    add_server_args(p, startup_s=240.0, request_s=120.0)
    add_output_args(p, "ttft_pd", quick_help="smoke run: 3 requests per workload")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("ttft_pd", build_parser(), argv)
    if args.quick:
        args.requests, args.rounds = min(args.requests, 3), 1
    workloads = [w for w in args.workloads.split(",") if w.strip()]
    backends = [b for b in args.backends.split(",") if b.strip()]
    cores = {"colocated": parse_cores(args.colocated_cores), "prefill": parse_cores(args.prefill_cores),
             "decode": parse_cores(args.decode_cores)}
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    model = resolve_model(args)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {','.join(WORKLOADS)}")
    wants_long = {"text_2k", "text_2k_hit"} & set(workloads)
    long, long_tokens = long_text(model, args.long_tokens, system(0)) if wants_long else ("", 0)
    bodies = Bodies(tuple(workloads), long, args.max_tokens)
    print(f"model {model}; text_2k = {long_tokens} prompt tokens; client pid {os.getpid()} on cores "
          f"{client_cores or 'any'}; load {loadavg()}", flush=True)

    plan: list[tuple[str, dict[str, list[str]] | None]] = [] if args.no_colocated else [("colocated", {"colocated": []})]
    plan += [(f"pd-{backend}", None) for backend in backends]
    runs: dict[str, list[dict]] = {name: [] for name, _ in plan}
    for round_index in range(args.rounds):  # the same sequence again: drifting outside load hits every system
        for name, roles in plan:
            if roles is None:  # a fresh bootstrap port per pair
                backend = name.removeprefix("pd-")
                roles = {"prefill": ["--transfer", backend, "--bootstrap-port", str(free_port())],
                         "decode": ["--transfer", backend]}
            print(f"--- round {round_index + 1}/{args.rounds}: {name}", flush=True)
            runs[name].append({**run_phase(name, roles, cores, args, model, bodies, out, round_index + 1),
                               "round": round_index + 1})
    phases = [merge_runs(name, runs[name], workloads) for name, _ in plan]
    ratios = ratios_vs_colocated(phases, workloads)
    report = {
        "benchmark": "ttft_pd",
        "pinning": {
            "colocated": cores["colocated"] or None, "prefill": cores["prefill"] or None,
            "decode": cores["decode"] or None, "client": {"pid": os.getpid(), "cores": client_cores or None},
            "torch_threads": args.threads,
            "note": "phases ran one after another, never at once; each server's pid is under phases[].runs[].servers",
        },
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "workloads": workloads,
                   "text_2k_prompt_tokens": long_tokens, "requests": args.requests, "rounds": args.rounds,
                   "gap_s": args.gap_s, "max_tokens": args.max_tokens, "stream": True, "temperature": 0,
                   "ignore_eos": True, "cache": {w: CACHE[w] for w in workloads}, "backends": backends,
                   "quick": args.quick, "server_args": args.server_arg,
                   "ttft": "send -> first SSE chunk with non-empty delta content (the decode's stream for PD)",
                   "breakdown": "PD only: per request, phases between the prefill's and the decode's room-timeline "
                                "events (GET /rooms/{room}, wall clock); analysis.CHAIN and SIDE"},
        "phases": phases,
        "ratios_pd_vs_colocated": ratios,
        "problems": cache_problems(phases, workloads, CACHE),
    }
    png = out.with_suffix(".png")
    plot(phases, workloads, png, f"TTFT, {args.family}-{args.size}, 1 request at a time, {args.threads} torch thread(s); "
                                 f"P core {args.prefill_cores}, D core {args.decode_cores}, colocated core "
                                 f"{args.colocated_cores}")
    print_table(phases, workloads)
    print_breakdown(phases, workloads)
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    summary = record.finish(out, report, None if report["problems"] else figures(phases, ratios, workloads))
    print(f"wrote {out}, {png} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
