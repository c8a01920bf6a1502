"""``python -m bench.kv_transfer``: flags, the source pool, each backend's run, the JSON and the
summary (the package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import os
import sys

from bench.common.args import add_cores_args, add_model_args, add_output_args, make_parser, output_path, resolve_model
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder
from bench.kv_transfer import __doc__ as DOC
from bench.kv_transfer.analysis import GOAL_RATIO, goal
from bench.kv_transfer.layout import POOL_HEADROOM, layout_shape, make_layout
from bench.kv_transfer.measure import run_backend
from bench.kv_transfer.paths import PATHS
from bench.kv_transfer.report import figures, plot, print_table
from transfer.registry import BACKENDS


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.kv_transfer")
    add_model_args(p, family_help="model family whose KV layout is used")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated transfer backends")
    p.add_argument("--tokens", default="512,2048,8192", help="comma-separated prompt lengths")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--reps", type=int, default=40,
                   help="timed repetitions per cell and path (4x up to 4 MiB, 2/3 of it from 32 MiB)")
    p.add_argument("--warmup", type=int, default=3, help="untimed moves per cell and path first")
    p.add_argument("--micro-iters", type=int, default=200, help="iterations of each breakdown part")
    add_cores_args(p, {"initiator": ("0", "this process (initiator, memcpy)"), "target": ("1", "the target process")})
    p.add_argument("--timeout", type=float, default=30.0, help="TransferConfig.timeout_s")
    p.add_argument("--seed", type=int, default=0, help="seed of the fragmented block lists and the path order")
    add_output_args(p, "kv_transfer", quick_help="smoke run: 8 repetitions, 1 warm-up")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("kv_transfer", build_parser(), argv)
    if args.quick:
        args.reps, args.warmup, args.micro_iters = min(args.reps, 8), 1, min(args.micro_iters, 50)
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    backends = [b for b in args.backends.split(",") if b.strip()]
    initiator_cores, target_cores = pin_this_process(args.initiator_cores), parse_cores(args.target_cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = output_path(args)
    model = resolve_model(args)
    shape = layout_shape(model, args.block_size)

    import torch

    from stages.engine.kv_pool import KVPool

    torch.set_num_threads(1)
    pool_blocks = POOL_HEADROOM * max(-(-t // args.block_size) for t in args.tokens)
    layout = make_layout(shape, pool_blocks)
    source = KVPool(layout)
    source.tensor.copy_(torch.randn(source.tensor.shape, generator=torch.Generator().manual_seed(args.seed)))
    memcpy_dst = torch.zeros_like(source.tensor)
    print(f"layout {shape}, float32: {layout.block_bytes} B/block, {layout.bytes_per_token} B/token; pools of "
          f"{pool_blocks} blocks ({source.nbytes / 2**20:.0f} MiB) each side; initiator pid {os.getpid()} on cores "
          f"{initiator_cores or 'any'}, target on {target_cores or 'any'}; load {loadavg()}", flush=True)
    results = [run_backend(name, args, shape, pool_blocks, source.tensor, memcpy_dst, target_cores)
               for name in backends]
    report = {
        "benchmark": "kv_transfer",
        "pinning": {
            "initiator_and_memcpy": {"pid": os.getpid(), "cores": initiator_cores or None, "torch_threads": 1},
            "target": {"pids": {r["backend"]: r["target_pid"] for r in results}, "cores": target_cores or None},
            "note": "library threads (Mooncake TCP workers, NIXL/UCX progress thread) inherit their process's cores",
        },
        "config": {"family": args.family, "size": args.size, "model_dir": str(model),
                   "layout": {**shape, "dtype": "float32", "block_bytes": layout.block_bytes,
                              "bytes_per_token": layout.bytes_per_token, "pool_blocks": pool_blocks},
                   "tokens": args.tokens, "reps": args.reps, "warmup": args.warmup, "micro_iters": args.micro_iters,
                   "timeout_s": args.timeout, "seed": args.seed, "quick": args.quick, "paths": PATHS,
                   "gb": "1e9 bytes"},
        "results": results,
        "goal": goal(results),
    }
    png = out.with_suffix(".png")
    plot(results, png, f"KV move, {args.family}-{args.size} layout ({layout.block_bytes // 1024} KiB blocks), "
                       f"initiator core {args.initiator_cores or 'any'}, target core {args.target_cores or 'any'}")
    print_table(results)
    for r in results:
        ph = r["phase"]
        print(f"{r['backend']}: wall {ph['wall_s']} s, initiator cpu {ph['initiator_cpu_s']} s, target cpu "
              f"{ph['target_cpu_s']} s, core busy {ph['core_busy_fraction']}, load {ph['loadavg_1m']}; other processes: "
              + "; ".join(f"{p['cpu_s']} s core {p['last_core']} {p['cmd'][:60]}" for p in ph["other_processes"][:3]))
    print(f"goal ours/raw >= {GOAL_RATIO}: {'met' if report['goal']['met'] else 'NOT met'} "
          f"{report['goal']['below'] or ''}")
    summary = record.finish(out, report, figures(results))
    print(f"wrote {out}, {png} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
