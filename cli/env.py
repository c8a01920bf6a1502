"""``stage env``: this machine's facts for the stage servers and a verdict per role (``stages.envcheck``).

    stage env [--redis-url URL | --redis-url-file PATH] [--device auto] [--transfer both] [--json]

Exit code 0 whatever the verdicts (it is a report: read ``ok`` / ``NOT OK`` or the JSON's ``verdicts``);
2 for a bad flag or an unreadable ``--redis-url-file``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from process.secrets import REDIS_URL_ENV, read_secret
from stages.engine.config import DEVICE_HELP, check_device

TRANSFER_CHOICES = ("both", "mooncake", "nixl")


def add_env_parser(commands: argparse._SubParsersAction) -> None:
    env = commands.add_parser("env", help="what this machine has for the stages (torch, GPUs, Mooncake, NIXL, UCX, "
                              "RDMA, Redis) and whether encoder, prefill and decode can run here",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    env.add_argument("--redis-url", default=None,
                     help=f"PING this Redis (or --redis-url-file, or {REDIS_URL_ENV}); its password is never printed")
    env.add_argument("--redis-url-file", default=None, metavar="PATH", help="a file holding --redis-url")
    env.add_argument("--redis-timeout-s", type=float, default=1.0, help="how long the PING may take")
    env.add_argument("--device", type=_device, default="auto", help=f"the stages' --device: {DEVICE_HELP}")
    env.add_argument("--transfer", choices=TRANSFER_CHOICES, default="both",
                     help="the KV transfer backend(s) prefill and decode would use")
    env.add_argument("--json", action="store_true", help="everything as one JSON object, for bug reports")
    env.set_defaults(run=run)


def _device(spec: str) -> str:
    try:
        check_device(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def run(args: argparse.Namespace) -> int:
    try:
        url = read_secret(args.redis_url, args.redis_url_file, flag="--redis-url", env=REDIS_URL_ENV,
                          environ=os.environ)
    except ValueError as exc:
        print(f"stage env: error: {exc}", file=sys.stderr)
        return 2
    from stages.envcheck.gather import gather_facts
    from stages.envcheck.render import as_json, text
    from stages.envcheck.verdict import TRANSFERS, verdicts

    facts = gather_facts(url, args.redis_timeout_s)
    transfers = TRANSFERS if args.transfer == "both" else (args.transfer,)
    judged = verdicts(facts, args.device, transfers)
    print(json.dumps(as_json(facts, args.device, judged), indent=2) if args.json else text(facts, args.device, judged))
    return 0
