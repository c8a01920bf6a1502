"""The ``stage`` command: the roof of the import graph. It imports its subcommands, one module each,
and nothing imports it (``tests/test_import_graph.py``); what the subcommands share with the tests
and the benchmarks (ports, processes, health waits, stacks) is the launching package, ``stages.launch``.

    stage serve colocated --model DIR [--host 127.0.0.1] [--port 8000] [...]      (cli/serve.py)
    stage serve encoder --model DIR --redis-url URL [--port 8300] [--max-batch-images 16] [...]
    stage serve prefill|decode --model DIR --transfer X [...]
    stage serve pd --model DIR --transfer X --admin-token T   (a switchable worker: stages/disagg/switchable.py)
    stage serve router --port N --prefill URL --decode URL | --colocated URL [...]   (cli/router.py)
    stage admin workers|add|drain|resume|remove|pairing|ratio|room [--router URL] [...]   (cli/admin.py)
    stage make-model --family qwen2_vl --size tiny --out DIR   (cli/make_model.py)
    stage demo [--mode colocated|pd|epd] [--family qwen2_vl] [--workdir DIR]   (stages/launch/demo.py)
    stage up [--mode epd|pd|colocated] [--model DIR | --family F --size S] [--port N] [...]   (stages/launch/up.py)
    stage bench serve|compare ...   (bench/cli.py)
    stage env [--redis-url URL] [--device auto] [--transfer both] [--json]   (cli/env.py, stages/envcheck/)

Building the parser imports no torch, transformers, aiohttp or fastapi, so ``--help`` answers at
once; each subcommand loads what it needs in its run. ``python -m cli`` is the same command.
"""

from __future__ import annotations

import argparse
import logging

from bench.cli import add_parser as add_bench_parser
from cli.admin import add_admin_args
from cli.env import add_env_parser
from cli.make_model import add_make_model_parser
from cli.router import add_router_parser
from cli.serve import add_role_parsers
from stages.launch.demo import add_demo_args, run_demo
from stages.launch.up import add_up_args
from stages.launch.up import run as run_up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stage", description="Encode / prefill / decode stage servers.")
    commands = parser.add_subparsers(dest="command", required=True)

    roles = commands.add_parser("serve", help="run one stage server").add_subparsers(dest="role", required=True)
    add_role_parsers(roles)
    add_router_parser(roles)
    add_make_model_parser(commands)

    demo = commands.add_parser("demo", help="make a model, serve it, send one image+text chat request",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_demo_args(demo)
    demo.set_defaults(run=run_demo)

    up = commands.add_parser("up", help="start a whole stack behind the router on this machine, until Ctrl-C",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_up_args(up)
    up.set_defaults(run=run_up)

    add_admin_args(commands.add_parser("admin", help="the router's admin API: workers, pairing, ratio, rooms"))
    add_bench_parser(commands)
    add_env_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level.upper() if args.command == "serve" else "WARNING"  # demo prints its own lines
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)
