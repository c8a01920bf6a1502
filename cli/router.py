"""``stage serve router``: the router's flags, the validated ``RouterConfig`` of a command line, and
its run (bind the port first, give the router its start id, serve). Building the parser imports
nothing heavy (no aiohttp, no torch), so ``stage --help`` stays fast; the server loads in ``run``.

    stage serve router --port N [--prefill URL ... --decode URL ... | --colocated URL ...]
                       [--discover ROLE=dns://NAME:PORT | ROLE=dns+srv://NAME ...]
                       [--encoder URL ... --redis-url URL] [--policy-ROLE NAME] [limits, deadlines]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import MISSING, fields

from process.instance import instance_id
from process.ports import bind
from process.secrets import REDIS_URL_ENV, TOKEN_ENV, read_secret
from router.config import ROLE_POLICIES, RouterConfig
from router.plan.prefix_tree import CHUNK_CHARS, IMAGE_CHARS
from telemetry import TracingConfig, add_tracing_args

_D = {f.name: f.default for f in fields(RouterConfig) if f.default is not MISSING}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workers (the mode follows from the roles given)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL", help="prefill server (repeatable)")
    g.add_argument("--decode", action="append", default=[], metavar="URL", help="decode server (repeatable)")
    g.add_argument("--colocated", action="append", default=[], metavar="URL", help="colocated server (repeatable)")
    g.add_argument("--encoder", action="append", default=[], metavar="URL", help="encoder server (repeatable; epd)")
    g.add_argument("--discover", action="append", default=[], metavar="ROLE=dns://NAME:PORT",
                   help="find ROLE's workers by DNS, re-resolved every --discover-interval-s: NAME's A/AAAA "
                        "addresses with PORT, or ROLE=dns+srv://NAME for its SRV records (repeatable; may be "
                        "mixed with URL flags; docs/router.md)")
    g.add_argument("--discover-interval-s", type=float, default=_D["discover_interval_s"],
                   help="between two resolutions of the --discover names")
    g.add_argument("--discover-nameserver", default=None, metavar="IP[:PORT]",
                   help="the DNS server --discover asks (default: the system's, /etc/resolv.conf)")
    g.add_argument("--redis-url", default=None,
                   help=f"embedding cache index (epd); or --redis-url-file, or the {REDIS_URL_ENV} environment variable")
    g.add_argument("--redis-url-file", default=None, metavar="PATH",
                   help="a file holding --redis-url (one trailing newline is dropped): its password stays off argv")
    g.add_argument("--cache-ttl-s", type=float, default=_D["cache_ttl_s"],
                   help="epd: an entry the router finds is kept this long (give the stages' value)")
    g.add_argument("--cache-op-timeout-s", type=float, default=_D["cache_op_timeout_s"],
                   help="epd: deadline of each Redis call")
    g.add_argument("--claim-lease-s", type=float, default=_D["claim_lease_s"],
                   help="epd: a claim the router takes for an encoder lapses after this unless the encoder renews it")
    g.add_argument("--local-encode", choices=("never", "auto", "always"), default=_D["local_encode"],
                   help="epd: let a request's own prefill encode its missing images (a switchable `stage serve pd "
                        "--redis-url` worker can; same claim, same cache entry) instead of an encoder: auto when "
                        "every encoder is saturated (--local-encode-queue) or none is eligible")
    g.add_argument("--local-encode-queue", type=int, default=_D["local_encode_queue"],
                   help="epd, --local-encode auto: an encoder with this many encode calls in flight is saturated")
    p = parser.add_argument_group("policies")
    for role, choices in ROLE_POLICIES.items():
        p.add_argument(f"--policy-{role}", choices=choices, default=_D[f"policy_{role}"], help=f"picks the {role}"
                       + (" (prefix_aware: the worker already sent the longest prefix of the conversation, "
                          "unless loads are imbalanced; docs/router.md)" if "prefix_aware" in choices else ""))
    p.add_argument("--prefix-cache-threshold", type=float, default=_D["prefix_cache_threshold"],
                   help="prefix_aware: the worker with the longest match gets the request if its match covers at "
                        f"least this share of the request's text (an image counts as {IMAGE_CHARS} characters); "
                        "below it, the worker whose prefix tree is smallest")
    p.add_argument("--prefix-balance-abs", type=int, default=_D["prefix_balance_abs"],
                   help="prefix_aware: loads are imbalanced, and the least loaded worker gets the request, when the "
                        "most and the fewest requests in flight differ by more than this ...")
    p.add_argument("--prefix-balance-rel", type=float, default=_D["prefix_balance_rel"],
                   help="... and the most is more than this times the fewest")
    p.add_argument("--prefix-tree-nodes", type=int, default=_D["prefix_tree_nodes"],
                   help="prefix_aware: the router's picture of each worker's cache holds at most this many nodes "
                        f"(a node: up to {CHUNK_CHARS} characters of a message, or one image; about 120 bytes), least "
                        "recently used evicted first")
    h = parser.add_argument_group("http")
    h.add_argument("--host", default=_D["host"], help="address to bind")
    h.add_argument("--port", type=int, default=_D["port"], help="port to bind (0: any free port)")
    h.add_argument("--max-body-mb", type=float, default=_D["max_body_mb"], help="request body size cap (413)")
    h.add_argument("--max-in-flight", type=int, default=_D["max_in_flight"],
                   help="requests held at once; more get 503 with Retry-After")
    h.add_argument("--allowed-image-hosts", nargs="+", action="extend", default=[], metavar="HOST[:PORT]",
                   help="hosts whose http(s) image URLs the router fetches (none by default)")
    h.add_argument("--image-fetch-timeout-s", type=float, default=_D["image_fetch_timeout_s"],
                   help="deadline of one image fetch")
    h.add_argument("--max-image-bytes", type=int, default=_D["max_image_bytes"], help="one fetched image, at most")
    h.add_argument("--max-videos-per-request", type=int, default=_D["max_videos_per_request"],
                   help="videos per request, all messages together (400 too_many_videos)")
    h.add_argument("--max-video-mb", type=float, default=_D["max_video_mb"],
                   help="one video fetched from an --allowed-image-hosts URL, at most (413 video_too_large)")
    h.add_argument("--max-images-per-request", type=int, default=_D["max_images_per_request"],
                   help="images per request")
    h.add_argument("--log-level", default=_D["log_level"], choices=["debug", "info", "warning", "error"])
    r = parser.add_argument_group("resilience")
    r.add_argument("--upstream-timeout-s", type=float, default=_D["upstream_timeout_s"],
                   help="deadline of one call to a stage, to its last byte")
    r.add_argument("--connect-timeout-s", type=float, default=_D["connect_timeout_s"],
                   help="deadline of opening a connection to a stage")
    r.add_argument("--stream-idle-timeout-s", type=float, default=_D["stream_idle_timeout_s"],
                   help="an upstream stream that sends no byte this long (the stages' keep-alives included: give "
                        "more than their --stream-keepalive-s) ends the client's stream with upstream_idle_timeout")
    r.add_argument("--upstream-host-timeout-s", type=float, default=_D["upstream_host_timeout_s"],
                   help="TCP keepalive / TCP_USER_TIMEOUT on upstream connections: a stage's host silent at the TCP "
                        "level this long (vanished, link down) fails the call, stream or not")
    r.add_argument("--retries", type=int, default=_D["retries"],
                   help="fresh attempts after a stage failed before anything reached the client")
    r.add_argument("--health-interval-s", type=float, default=_D["health_interval_s"], help="between health checks")
    r.add_argument("--health-timeout-s", type=float, default=_D["health_timeout_s"], help="deadline of one check")
    r.add_argument("--health-timeouts", type=int, default=_D["health_timeouts"],
                   help="consecutive checks past --health-timeout-s that mark a worker unhealthy (a refused "
                        "connection or an error answer marks it at once)")
    r.add_argument("--breaker-failures", type=int, default=_D["breaker_failures"],
                   help="consecutive failures that open a worker's circuit")
    r.add_argument("--breaker-cooldown-s", type=float, default=_D["breaker_cooldown_s"],
                   help="an open circuit lets a trial request through after this long")
    r.add_argument("--startup-timeout-s", type=float, default=_D["startup_timeout_s"],
                   help="wait this long for every worker to answer at startup")
    r.add_argument("--shutdown-grace-s", type=float, default=_D["shutdown_grace_s"],
                   help="on SIGTERM: stop accepting, let the requests in flight (streams included) finish within "
                        "this, then exit 0")


    a = parser.add_argument_group("admin API (docs/admin.md)")
    a.add_argument("--admin-token", default=None,
                   help=f"bearer token of /admin/* (or --admin-token-file, or the {TOKEN_ENV} environment "
                        "variable); without one the admin API answers 403")
    a.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help="a file holding --admin-token (one trailing newline is dropped)")
    a.add_argument("--room-history", type=int, default=_D["room_history"], help="rooms whose timelines are kept")
    a.add_argument("--ratio-window-s", type=float, default=_D["ratio_window_s"],
                   help="demand, utilization and capacity are measured over this window")
    a.add_argument("--auto-ratio-interval-s", type=float, default=_D["auto_ratio_interval_s"],
                   help="apply the recommended split (of --auto-ratio-roles) this often, with hysteresis (0: never)")
    a.add_argument("--auto-ratio-roles", type=lambda text: tuple(text.split(",")), default="encoder,prefill,decode",
                   help="the roles the automatic loop moves switchable workers between: encoder,prefill,decode, or "
                        "prefill,decode to keep the encoders fixed")
    a.add_argument("--drain-timeout-s", type=float, default=_D["drain_timeout_s"],
                   help="a role switch gives up on a worker still busy after this long")
    add_tracing_args(parser)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The validated config of a command line; ValueError names the flag to change. The secrets
    (``--redis-url``, ``--admin-token``) come from the flag, its ``-file`` flag or the environment
    (``process.secrets.read_secret``)."""
    names = {f.name for f in fields(RouterConfig)}
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    for name in ("prefill", "decode", "colocated", "encoder", "allowed_image_hosts", "discover"):
        values[name] = tuple(values[name])
    values["admin_token"] = read_secret(args.admin_token, args.admin_token_file, flag="--admin-token", env=TOKEN_ENV,
                                        environ=os.environ)
    values["tracing"] = TracingConfig.from_args(args, "router", instance_id="", model="")
    values["redis_url"] = read_secret(args.redis_url, args.redis_url_file, flag="--redis-url", env=REDIS_URL_ENV,
                                      environ=os.environ)
    return RouterConfig(**values)

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
    except ValueError as exc:  # process.ports.PortError included
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
