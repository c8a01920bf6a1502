"""``stage bench ...``: the benchmark subcommands, added to the ``stage`` parser by the CLI (``cli``).
Building the parsers imports only argparse and the benchmarks' configs; each run imports the rest."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the ``stage`` command's subparsers."""
    from bench.compare.cli import add_args as add_compare_args, run as run_compare
    from bench.serve.cli import add_args as add_serve_args, run as run_serve

    bench = commands.add_parser("bench", help="benchmarks of OpenAI-compatible chat servers (bench/README.md)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    serve = kinds.add_parser("serve", help="drive an OpenAI-compatible chat endpoint and measure it",
                             description="Drive any OpenAI-compatible chat endpoint with a seeded synthetic "
                             "multimodal mix or a recorded JSONL workload; report TTFT, TPOT, ITL, E2EL, "
                             "throughput, goodput and failures.",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(run=run_serve)
    compare = kinds.add_parser("compare", help="colocated vs 1P1D vs 1E1P1D on this machine, the same workloads",
                               description="Start a colocated, a 1P1D and a 1E1P1D stack one after the other, "
                               "pinned to the same cores, drive each with the same workloads and report TTFT, TPOT, "
                               "goodput and E2E with ratios against colocated (bench/README.md).",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_compare_args(compare)
    compare.set_defaults(run=run_compare)
