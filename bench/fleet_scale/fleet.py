"""A fake fleet in one process: ``--prefill N`` and ``--decode N`` workers, each on a port of its own
(bound to port 0 on loopback), with the routes and answers of ``bench/fake_backend.py`` (its
``make_app``) plus ``GET /metrics``: the recorded load (``bench.fleet_scale.load``) at the seconds
since this process started. Writes ``{"prefill": [urls], "decode": [urls]}`` to ``--ports-file`` once
every port listens; ends on SIGTERM or SIGINT.

    python -m bench.fleet_scale.fleet --prefill 8 --decode 8 --ports-file F [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ for fake_backend (a script, not a module)
from fake_backend import make_app, serve_until_signalled  # noqa: E402

from bench.fleet_scale.load import metrics_text  # noqa: E402


async def main(args: argparse.Namespace) -> None:
    stats: Counter = Counter()
    started = time.monotonic()
    runners, urls = [], {"prefill": [], "decode": []}
    backend = argparse.Namespace(bootstrap_port=args.bootstrap_port, itl_ms=0.0, tokens=args.tokens, token_bytes=1)
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for index in range(count):
            app = make_app(role, backend, stats)

            async def metrics(_: web.Request, role: str = role, index: int = index) -> web.Response:
                return web.Response(text=metrics_text(role, index, time.monotonic() - started),
                                    content_type="text/plain")

            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            urls[role].append(f"http://127.0.0.1:{port}")
            runners.append(runner)
    tmp = Path(args.ports_file + ".tmp")
    tmp.write_text(json.dumps(urls))
    tmp.rename(args.ports_file)
    print(f"fake fleet: {args.prefill} prefill, {args.decode} decode", flush=True)
    await serve_until_signalled(runners)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, required=True)
    parser.add_argument("--decode", type=int, required=True)
    parser.add_argument("--ports-file", required=True)
    parser.add_argument("--bootstrap-port", type=int, default=1, help="reported in the prefills' /server_info")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per decode answer")
    asyncio.run(main(parser.parse_args()))
