"""``stage serve router``: the router's flags (``router.cli``) and its run. The run is here, in the
CLI, because it binds the port and gives the router its start id with the launching package
(``stages.launch``), which the router cannot import (it imports nothing of ``stages``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from router.cli import add_router_args, router_config
from stages.launch.instance import instance_id
from stages.launch.ports import bind


def add_router_parser(roles: argparse._SubParsersAction) -> None:
    """``stage serve router``; building it imports nothing heavy (the server loads in ``run``)."""
    parser = roles.add_parser("router", help="the OpenAI front door over stage servers",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_router_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Validate the flags and bind ``--port`` before importing the server, so a bad flag or a port in
    use is one line on stderr and exit code 2, at once; then serve until SIGINT/SIGTERM."""
    try:
        config = dataclasses.replace(router_config(args), instance_id=instance_id())
        sock = bind(config.host, config.port)
    except ValueError as exc:  # stages.launch.ports.PortError included
        print(f"stage serve router: error: {exc}", file=sys.stderr)
        return 2
    from router.runtime import StartupError
    from router.server import serve

    try:
        serve(config, sock)
    except StartupError as exc:
        print(f"stage serve router: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0
