"""``stage bench ...``: the benchmark subcommands, added to the ``stage`` parser by ``stages/cli.py``.
Building the parsers imports only argparse and the benchmarks' configs; each run imports the rest."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the ``stage`` command's subparsers."""
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
