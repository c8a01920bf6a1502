"""``python -m bench.kv_link``: flags, the rig, each backend's run, the JSON and the summary (the
package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from bench.common.args import add_cores_args, add_model_args, add_output_args, make_parser, output_path, resolve_model
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores
from bench.common.record import Recorder
from bench.kv_link import __doc__ as DOC
from bench.kv_link.analysis import GOAL_RATIO, goal
from bench.kv_link.measure import PATHS, run_backend
from bench.kv_link.report import figures, plot, print_table
from bench.kv_link.workload import LAYOUTS, cells, pool_blocks
from bench.kv_transfer.layout import layout_shape, make_layout

BACKENDS = ("mooncake", "nixl")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.kv_link")
    add_model_args(p, family_help="model family whose KV layout is used")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated transfer backends (over tcp)")
    p.add_argument("--sizes-mib", default="16,64", help="comma-separated KV sizes moved, MiB")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="remote block layouts: contiguous, fragmented")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per cell and path (2/3 of it above 16 MiB)")
    p.add_argument("--warmup", type=int, default=3, help="untimed moves per cell and path first")
    p.add_argument("--source-host", default="p1", help="the rig host of the source (a prefill's role)")
    p.add_argument("--sink-host", default="d1", help="the rig host of the sink (a decode's role)")
    p.add_argument("--family-ip", type=int, default=4, choices=(4, 6), help="the rig's address family")
    p.add_argument("--tcp-chunk-kib", type=int, default=128,
                   help="the tcp path's bytes per sendall / recv_into call (each op split into pieces of this)")
    p.add_argument("--ucx-tls", default="tcp",
                   help="UCX_TLS of the nixl workers: tcp keeps UCX off shared memory and CMA, which reach between "
                        "two namespaces of one machine (not over the link) but not between hosts; '' : UCX's choice")
    add_cores_args(p, {"source": ("0", "the source process"), "sink": ("1", "the sink process")})
    p.add_argument("--timeout", type=float, default=30.0, help="TransferConfig.timeout_s")
    p.add_argument("--seed", type=int, default=0, help="seed of the source pool, the fragmented ids and the order")
    add_output_args(p, "kv_link", quick_help="smoke run: 16 MiB contiguous only, 5 repetitions, 1 warm-up")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("kv_link", build_parser(), argv)
    if args.quick:
        args.sizes_mib, args.layouts, args.reps, args.warmup = "16", "contiguous", min(args.reps, 5), 1
    sizes = [int(s) for s in args.sizes_mib.split(",") if s.strip()]
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.source_cores, args.sink_cores = parse_cores(args.source_cores), parse_cores(args.sink_cores)
    out = output_path(args)
    shape = layout_shape(resolve_model(args), args.block_size)
    block_bytes = make_layout(shape, 1).block_bytes
    pool = pool_blocks(sizes, block_bytes)
    work = cells(sizes, layouts, block_bytes, pool, random.Random(args.seed))

    # a checkout's test rig (tests/ is not part of the bench distribution): imported here, not at module level
    from tests.multihost.rig import Rig, require_namespaces, sweep

    require_namespaces()
    sweep()
    rig = Rig(out.parent / f"{out.stem}_rig", family=args.family_ip)
    rig.up()
    try:
        print(f"rig {rig.prefix}: source {args.source_host} {rig.addr(args.source_host)} (cores "
              f"{args.source_cores or 'any'}), sink {args.sink_host} {rig.addr(args.sink_host)} (cores "
              f"{args.sink_cores or 'any'}); layout {shape}, float32, {block_bytes} B/block; pools of {pool} blocks "
              f"({pool * block_bytes / 2**20:.0f} MiB); load {loadavg()}", flush=True)
        results = [run_backend(name, args, rig, shape, pool, work) for name in backends]
    finally:
        rig.down()
    report = _report(args, shape, block_bytes, pool, sizes, layouts, backends, results)
    png = out.with_suffix(".png")
    plot(results, png, f"KV over one rig link ({args.source_host} -> bridge -> {args.sink_host}, veth), "
                       f"{args.family}-{args.size} layout ({block_bytes // 1024} KiB blocks)")
    print_table(results)
    for r in results:
        ph = r["phase"]
        print(f"{r['backend']}: wall {ph['wall_s']} s, source cpu {ph['source_cpu_s']} s, sink cpu "
              f"{ph['sink_cpu_s']} s, core busy {ph['core_busy_fraction']}, load {ph['loadavg_1m']}; other processes: "
              + "; ".join(f"{p['cpu_s']} s {p['cmd'][:50]}" for p in ph["other_processes"][:3]))
    verdict = report["goal"]
    off_link = ", ".join(verdict["not_over_link"])
    print(f"goal ours / raw TCP >= {GOAL_RATIO}: {'met' if verdict['met'] else 'NOT met'} {verdict['below'] or ''}"
          f"{'; not over the link: ' + off_link if off_link else ''}")
    summary = record.finish(out, report, figures(results))
    print(f"wrote {out}, {png} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


def _report(args: argparse.Namespace, shape: dict, block_bytes: int, pool: int, sizes: list[int],
            layouts: list[str], backends: list[str], results: list[dict]) -> dict:
    return {
        "benchmark": "kv_link",
        "rig": {"source": args.source_host, "sink": args.sink_host, "family": args.family_ip,
                "link": "veth pair per host on one Linux bridge, each host its own network namespace"},
        "pinning": {"source_cores": args.source_cores or None, "sink_cores": args.sink_cores or None,
                    "note": "library threads (Mooncake TCP workers, NIXL/UCX progress thread) and the TCP "
                            "receiver thread inherit their process's cores"},
        "config": {"family": args.family, "size": args.size, "layout": {**shape, "dtype": "float32",
                   "block_bytes": block_bytes, "pool_blocks": pool}, "sizes_mib": sizes, "layouts": layouts,
                   "backends": backends, "paths": PATHS, "tcp_chunk_kib": args.tcp_chunk_kib, "reps": args.reps,
                   "warmup": args.warmup, "timeout_s": args.timeout, "seed": args.seed, "quick": args.quick,
                   "gb": "1e9 bytes"},
        "results": results,
        "goal": goal(results),
    }


if __name__ == "__main__":
    sys.exit(main())
