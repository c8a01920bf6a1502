#!/usr/bin/env python3
"""The image's HEALTHCHECK: ``GET /health`` of the server the container runs; exit 0 on a 200 answer,
1 on anything else (an error answer, a refused or late connection), with one line saying which.

    epd-healthcheck [PID]        (PID 1, the container's main process, unless given)

The URL: ``$EPD_HEALTH_URL`` when set; otherwise read from the process's command line
(``/proc/PID/cmdline``) with ``stage``'s own parser, so it follows the flags exactly:
``stage serve ROLE`` -> its ``--host`` and ``--port`` (the role's default port when none is given),
``stage up`` -> its router on ``--port``. A wildcard ``--host`` (``0.0.0.0``, ``::``) is asked on
loopback. Any other command (``stage demo``, ``stage make-model``, a shell) serves nothing, so there is
nothing to check: exit 0, and so does a server on ``--port 0`` (its port is chosen at start). A command
line that does not parse is unhealthy.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 4.0  # under the Containerfile's HEALTHCHECK --timeout (5s)
URL_ENV = "EPD_HEALTH_URL"
LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def stage_argv(cmdline: list[str]) -> list[str] | None:
    """The arguments after ``stage`` (the console script) or ``-m cli``; None for another program."""
    for i, arg in enumerate(cmdline):
        if Path(arg).name == "stage":
            return cmdline[i + 1:]
        if arg == "-m" and cmdline[i + 1:i + 2] == ["cli"]:
            return cmdline[i + 2:]
    return None


def health_url(argv: list[str]) -> str | None:
    """The /health URL of the server ``stage *argv`` runs; None when that command serves nothing."""
    from cli import build_parser  # builds the parser only: no torch, no server modules

    if argv[:1] not in (["serve"], ["up"]) or "-h" in argv or "--help" in argv:
        return None
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed why; a server with these flags never started
        raise ValueError(f"the command line does not parse (exit {exc.code}): stage {' '.join(argv)}") from None
    if args.port == 0:
        return None  # any free port, chosen at start: not on the command line
    host = "127.0.0.1" if args.command == "up" else LOOPBACK.get(args.host, args.host)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{args.port}/health"


def check(url: str) -> tuple[bool, str]:
    """(healthy, what was seen) for one GET of ``url``."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            return answer.status == 200, f"{url}: {answer.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: {exc.code} {exc.read(300).decode(errors='replace')}"
    except (OSError, ValueError) as exc:  # refused, timed out, unreachable, a bad URL
        return False, f"{url}: {type(exc).__name__}: {exc}"


def main(argv: list[str]) -> int:
    url = os.environ.get(URL_ENV)
    if not url:
        pid = argv[0] if argv else "1"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        stage_args = stage_argv(cmdline)
        try:
            url = health_url(stage_args) if stage_args is not None else None
        except ValueError as exc:
            print(f"epd-healthcheck: unhealthy: {exc}")
            return 1
        if url is None:
            print(f"epd-healthcheck: process {pid} serves nothing ({' '.join(cmdline)[:200]}): healthy")
            return 0
    healthy, seen = check(url)
    print(f"epd-healthcheck: {'healthy' if healthy else 'unhealthy'}: {seen}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
