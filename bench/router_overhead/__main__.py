"""``python -m bench.router_overhead``: flags, the fake pair and the routers, the rounds, the JSON and
the summary (the package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.common.args import CACHE, add_cores_args, add_output_args, make_parser, output_path
from bench.common.children import REPO, Child
from bench.common.machine import loadavg
from bench.common.meter import CpuMeter
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.proc import thread_cpu
from bench.common.record import Recorder
from cache.embedded import EmbeddedRedis
from bench.router_overhead import __doc__ as DOC
from bench.router_overhead.analysis import check_stage_reach, compare, failed_targets, summarize
from bench.router_overhead.client import TOKENS, unique_images
from bench.router_overhead.measure import measure_target, profile
from bench.common.otlp_sink import OTLPSink
from bench.router_overhead.peers import PEERS, TRACED, ensure_peers, router_argv
from bench.router_overhead.report import figures, plot, print_table
from process.ports import free_port

STARTUP_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.router_overhead")
    p.add_argument("--peers-venv", default=os.path.join(CACHE, "peer-routers-venv"),
                   help="venv the peer routers are installed into (created on first use)")
    p.add_argument("--targets", default="direct,ours,sglang-router,vllm-router", help="comma-separated")
    p.add_argument("--requests-c1", type=int, default=1500, help="non-stream requests at concurrency 1, per round")
    p.add_argument("--requests-stream", type=int, default=300, help="stream requests at concurrency 1, per round")
    p.add_argument("--requests-c32", type=int, default=4000, help="requests at --concurrency, per round")
    p.add_argument("--concurrency", type=int, default=32, help="the throughput level")
    p.add_argument("--warmup", type=int, default=100, help="untimed requests per target and round")
    p.add_argument("--rounds", type=int, default=3, help="the sequence of targets runs this many times (pooled)")
    p.add_argument("--itl-ms", type=float, default=2.0, help="the fake decode's gap before each streamed token")
    add_cores_args(p, {"router": ("1", "every router"), "client": ("0", "this process (the client)"),
                       "backend": ("0", "the fake backend pair")})
    p.add_argument("--baseline", default=None, help="a checkout of another commit (e.g. `git archive REF | tar -x "
                   "-C DIR`): its router runs as target ours-base beside ours, in the same alternating rounds")
    p.add_argument("--epd", action=argparse.BooleanOptionalAction, default=True,
                   help="also our router(s) in epd mode (target ours-epd, and ours-base-epd with --baseline): a "
                   "fake encoder and a private Redis; each request carries an image of its own (a cache miss the "
                   "router claims and sends to the encoder)")
    p.add_argument("--tracing", action=argparse.BooleanOptionalAction, default=True,
                   help="also our router with OpenTelemetry traces kept at 100 %% and at 1 %% (targets ours-traced, "
                   "ours-traced-1pct), exporting to a sink in this process that decodes and drops them")
    p.add_argument("--py-spy", action="store_true", help="record our router with py-spy during an extra c=32 run")
    add_output_args(p, "router_overhead", quick_help="smoke run: 1 round, a quarter of the requests")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("router_overhead", build_parser(), argv)
    if args.quick:
        args.rounds = 1
        args.requests_c1, args.requests_stream, args.requests_c32 = (args.requests_c1 // 4, args.requests_stream // 4,
                                                                     args.requests_c32 // 4)
    out = output_path(args)
    venv = Path(args.peers_venv).expanduser()
    targets = [t for t in args.targets.split(",") if t]
    if args.baseline and "ours-base" not in targets:
        targets.insert(targets.index("ours") + 1 if "ours" in targets else len(targets), "ours-base")
    if args.epd:  # the EPD path: our router(s) in epd mode, each request with an image of its own
        targets += [f"{t}-epd" for t in ("ours", "ours-base") if t in targets and f"{t}-epd" not in targets]
    if args.tracing and "ours" in targets:  # tracing's cost: ours again, traced at 100 % and at 1 %
        targets += [t for t in TRACED if t not in targets]
    sink = OTLPSink().__enter__() if set(TRACED) & set(targets) else None
    versions, skipped = ensure_peers(venv) if set(targets) & set(PEERS) else ({}, {})
    client_cores = pin_this_process(args.client_cores)
    router_cores = parse_cores(args.router_cores)
    ports = {"prefill": free_port(), "decode": free_port(), "bootstrap": free_port(), "encoder": free_port()}
    epd_targets = [t for t in targets if t.endswith("-epd")]
    redis = EmbeddedRedis(64 << 20).start() if epd_targets else None
    epd = (f"http://127.0.0.1:{ports['encoder']}", redis.url) if redis is not None else None
    images = unique_images(args.requests_c32 + args.requests_c1 + args.requests_stream + 2 * args.warmup) \
        if epd_targets else None
    prefill, decode = f"http://127.0.0.1:{ports['prefill']}", f"http://127.0.0.1:{ports['decode']}"
    backend = Child("fake backend", [sys.executable, str(REPO / "bench" / "fake_backend.py"),
                                     "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
                                     "--bootstrap-port", str(ports["bootstrap"]), "--tokens", str(TOKENS),
                                     "--itl-ms", str(args.itl_ms),
                                     *(["--encoder-port", str(ports["encoder"])] if epd else [])],
                    parse_cores(args.backend_cores), out.with_name(out.stem + "_backend.log"), url=decode,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
    routers: dict[str, Child] = {}
    try:
        backend.wait(STARTUP_S)
        for name in targets:
            if name == "direct" or name in skipped:
                continue
            port = free_port()
            child = Child(name, router_argv(name, venv, port, prefill, decode, ports["bootstrap"], epd,
                                            sink.endpoint if sink is not None else None),
                          router_cores, out.with_name(out.stem + f"_{name}.log"), url=f"http://127.0.0.1:{port}",
                          env={**os.environ, "PYTHONUNBUFFERED": "1",
                               **({"PYTHONPATH": str(Path(args.baseline).resolve())} if "-base" in name else {})})
            try:
                child.wait(STARTUP_S)
                routers[name] = child
            except RuntimeError as exc:
                child.stop()
                skipped[name] = str(exc)
                print(f"skipping {name}: {exc}", flush=True)
        live = [t for t in targets if t == "direct" or t in routers]
        print(f"targets {live}; client pid {os.getpid()} on cores {client_cores or 'any'}, routers on "
              f"{router_cores or 'any'}, backend on {args.backend_cores or 'any'}; load {loadavg()}", flush=True)
        runs: dict[str, list[dict]] = {t: [] for t in live}
        meters = []
        for round_index in range(args.rounds):
            for target in live if round_index % 2 == 0 else live[::-1]:
                print(f"--- round {round_index + 1}/{args.rounds}: {target}", flush=True)
                meter = CpuMeter({os.getpid(), backend.proc.pid, *(r.proc.pid for r in routers.values())},
                                 "client_cpu_s")
                runs[target].append(measure_target(target, routers.get(target), prefill, decode, ports["bootstrap"],
                                                   args, images if target.endswith("-epd") else None))
                meters.append({"round": round_index + 1, "target": target, **meter.done()})
        spy = profile(routers["ours"], venv, out, args) if args.py_spy and "ours" in routers else None
        threads = {name: thread_cpu(r.proc.pid) for name, r in routers.items()}
    finally:
        for child in [*routers.values(), backend]:
            child.stop()
        if redis is not None:
            redis.stop()
        if sink is not None:
            sink.__exit__(None, None, None)

    failed = failed_targets(runs)
    for target, errors in failed.items():
        print(f"{target}: a phase got no answer right; first errors: {errors}", flush=True)
    results = {t: summarize(t, runs[t]) for t in live if t not in failed}
    unreached = check_stage_reach(results)
    comparison = compare(results)
    report = {
        "benchmark": "router_overhead",
        "pinning": {"routers": router_cores or None, "client": {"pid": os.getpid(), "cores": client_cores or None},
                    "backend": {"pid": backend.proc.pid, "cores": parse_cores(args.backend_cores) or None}},
        "config": {"targets": live, "requests_c1": args.requests_c1, "requests_stream": args.requests_stream,
                   "requests_c32": args.requests_c32, "concurrency": args.concurrency, "rounds": args.rounds,
                   "warmup": args.warmup, "tokens": TOKENS, "baseline": args.baseline, "epd": epd is not None, "itl_ms": args.itl_ms, "quick": args.quick,
                   "backend": "bench/fake_backend.py (no model)", "policies": "round_robin for prefill and decode",
                   "router_argv": {n: r.argv for n, r in routers.items()}},
        "peer_versions": versions, "skipped": skipped, "failed": failed, "results": results, **comparison,
        "traces_exported": sink.counts() if sink is not None else None,
        "phases": meters, "router_threads": threads, "py_spy": spy,
    }
    png = out.with_suffix(".png")
    plot(results, comparison, png, f"router overhead, PD mode, fake backends; routers on core(s) {args.router_cores}, "
                                   f"client {args.client_cores}, backend {args.backend_cores}; {args.rounds} round(s)")
    print_table(results, comparison)
    if unreached:
        record.finish(out, report, None)
        print("FAILED: a router did not reach the prefill and the decode exactly once per request (no summary "
              "written):\n  " + "\n  ".join(unreached), file=sys.stderr)
        return 1
    summary = record.finish(out, report, figures(results, comparison))
    print(f"wrote {out}, {png} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
