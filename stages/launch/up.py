"""``stage up``: everything one machine needs behind one OpenAI URL (a ``stages.launch.stack.Stack``),
started and stopped together, until Ctrl-C.

    stage up [--model DIR | --family F --size tiny|small] [--port N] [--mode epd|pd|colocated]
             [--device DEVICE[,...]] [--transfer mooncake|nixl] [--redis-url URL | --redis-url-file PATH]
             [--kv-cache-mib N]
             [--log-dir DIR] [--admin-token T | --admin-token-file PATH]

``--port`` (when not 0) is probed before anything starts, so a port in use is one line and exit 2 at
once. Children's logs go to ``--log-dir``, by default a new run directory under the cache dir (only
the last 10 runs are kept, ``stages.launch.run_logs``). ``--admin-token`` (or ``--admin-token-file``,
or ``EPD_ADMIN_TOKEN``) and, in epd mode, ``--redis-url`` (or ``--redis-url-file``, or
``EPD_REDIS_URL``) reach the router and the stage servers in their environment (never on a command
line; ``process.secrets``).

Building the parser imports no torch; the model is generated (first run only) in ``run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from process.secrets import REDIS_URL_ENV, read_secret
from stages.config import MIN_TOKEN_CHARS, TOKEN_ENV, TRANSFERS
from stages.launch.health import HEALTH_POLL_S
from stages.launch.models import DEFAULT_FAMILY, DEFAULT_SIZE, cache_dir, ensure_model
from process.ports import probe
from stages.launch.run_logs import new_run_dir
from stages.launch.placement import Machine, Placement, place
from stages.launch.stack import HOST, MODES, STAGE_ROLES, Say, Stack, StackConfig, StackError
from stages.model_dir import check_model_dir
from stages.modelgen import FAMILIES, SIZES


class _Stopped(BaseException):
    """SIGTERM (or SIGINT) reached ``stage up``: unwind to the stop."""


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """``stage up`` flags (no heavy imports)."""
    d = StackConfig(model=Path(), log_dir=Path())
    parser.add_argument("--model", default=None, help="checkpoint directory; default: the generated --family "
                        "model of --size, made on first run under the cache dir")
    parser.add_argument("--family", choices=FAMILIES, default=DEFAULT_FAMILY, help="model family to generate")
    parser.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE, help="model size to generate")
    parser.add_argument("--port", type=int, default=8080, help="the router's port (0: any free port)")
    parser.add_argument("--mode", choices=MODES, default=d.mode,
                        help="epd: encoder + prefill + decode (+ Redis); pd: prefill + decode; colocated: one server")
    parser.add_argument("--transfer", choices=TRANSFERS, default=None,
                        help="KV transfer (epd, pd); default: mooncake where its installed build can move the KV's "
                             "memory (a CUDA build for GPU memory), else nixl")
    add_redis_args(parser, "an embedded one")
    parser.add_argument("--log-dir", default=None, help="where every child's log goes; default: a new directory "
                        "under the cache dir")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads of each stage server")
    add_device_arg(parser)
    parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s,
                        help="every child must be healthy within this")
    parser.add_argument("--stop-timeout-s", type=float, default=d.stop_timeout_s,
                        help="SIGKILL a child that has not exited this long after SIGTERM")
    parser.add_argument("--kv-cache-mib", type=int, default=None,
                        help="KV pool of each prefill, decode or colocated server; default: theirs")
    parser.add_argument("--stage-arg", action="append", default=[], metavar="FLAG",
                        help="extra flag for every stage server, e.g. --stage-arg=--log-level=warning (repeatable)")
    parser.add_argument("--admin-token", default=None,
                        help=f"turns on the router's admin API (stage admin, docs/admin.md) with this bearer token "
                             f"(or the {TOKEN_ENV} environment variable), given to the router and the stages; "
                             f"at least {MIN_TOKEN_CHARS} characters")
    parser.add_argument("--admin-token-file", default=None, metavar="PATH",
                        help="a file holding --admin-token (one trailing newline is dropped)")


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """``--device`` of ``stage up`` and ``stage demo`` (``stages.launch.placement``)."""
    parser.add_argument("--device", default=None, metavar="DEVICE[,DEVICE...]",
                        help="--device of every stage server, or one per stage in start order (epd: encoder,prefill,"
                             "decode; pd: prefill,decode), e.g. cuda:0,cuda:1,cuda:2; default (auto): the GPUs torch "
                             "sees, one per stage while they last (stages sharing one split its memory), else the CPU")


def placed(config: StackConfig, args: argparse.Namespace, machine: Machine) -> StackConfig:
    """``config`` with every stage's device, memory share and the KV transfer decided for ``machine``
    (``stages.launch.placement.place``): ValueError, one line naming the fix, for what cannot work here."""
    placement = place(STAGE_ROLES[config.mode], tuple(args.device.split(",")) if args.device else (), args.transfer,
                      machine)
    return dataclasses.replace(config, devices=placement.devices, memory_shares=placement.memory_shares,
                               transfer=placement.transfer or config.transfer)


def placement_line(config: StackConfig) -> str:
    """Where a ``placed`` config's stages run, in one line (``Placement.describe``)."""
    roles = STAGE_ROLES[config.mode]
    return Placement(roles, config.devices, config.memory_shares or (None,) * len(roles),
                     config.transfer if len(roles) > 1 else None).describe()


def add_redis_args(parser: argparse.ArgumentParser, instead_of: str) -> None:
    """``--redis-url`` and ``--redis-url-file`` of ``stage up`` and ``stage demo``."""
    parser.add_argument("--redis-url", default=None,
                        help=f"epd: this Redis instead of {instead_of} (or --redis-url-file, or the {REDIS_URL_ENV} "
                             "environment variable); the stages get it in their environment, not on argv")
    parser.add_argument("--redis-url-file", default=None, metavar="PATH",
                        help="a file holding --redis-url (one trailing newline is dropped)")


def stack_redis_url(args: argparse.Namespace) -> str | None:
    """``--redis-url``, ``--redis-url-file``, or (epd only: the other modes have no cache, and a
    variable left in the shell must not refuse them) ``EPD_REDIS_URL``. SecretError names the flag."""
    environ = os.environ if args.mode == "epd" else {}
    return read_secret(args.redis_url, args.redis_url_file, flag="--redis-url", env=REDIS_URL_ENV, environ=environ)


def stack_config(args: argparse.Namespace, machine: Machine | None = None) -> StackConfig:
    """The validated config of a ``stage up`` command line on ``machine`` (None: ``Machine.here()``, read
    after the cheap checks, since it imports torch), its ``log_dir`` still unset. ValueError names the
    flag to change: a bad value, a device or transfer ``machine`` cannot serve (``placed``), a
    ``--model`` directory without what the stages load
    (``stages.model_dir``), a ``--port`` in use (``process.ports.PortError``)."""
    config = StackConfig(model=Path(args.model or "."), log_dir=Path(), mode=args.mode, port=args.port,
                         redis_url=stack_redis_url(args), threads=args.threads,
                         startup_timeout_s=args.startup_timeout_s, stop_timeout_s=args.stop_timeout_s,
                         kv_cache_mib=args.kv_cache_mib, stage_args=tuple(args.stage_arg),
                         admin_token=read_secret(args.admin_token, args.admin_token_file, flag="--admin-token",
                                                 env=TOKEN_ENV, environ=os.environ))
    if args.model is not None:
        check_model_dir(config.model, tokenizer=True)  # every mode runs a stage with a tokenizer
    if config.port:
        probe(HOST, config.port, "--port")
    return placed(config, args, machine or Machine.here())


def ready_line(url: str, admin: bool) -> str:
    """What ``stage up`` prints once its stack serves at ``url`` (the router's), admin API on or off."""
    admin_api = (f"admin API {url}/admin (stage admin --router {url}, with the --admin-token token)" if admin else
                 f"admin API off (give stage up --admin-token or {TOKEN_ENV})")
    return f"ready: {url}/v1 (OpenAI base URL); {admin_api}; Ctrl-C stops everything"


def run(args: argparse.Namespace) -> int:
    """The ``stage up`` command: start, print the URL, wait for a signal or a child's death, stop.
    Exit codes: 0 stopped by a signal, 1 a child failed (at startup or later), 2 a bad flag or a
    ``--port`` in use (answered before anything starts)."""
    try:
        config = stack_config(args)
    except ValueError as exc:
        print(f"stage up: error: {exc}", file=sys.stderr)
        return 2
    if args.model is None:
        config = dataclasses.replace(config, model=ensure_model(cache_dir() / f"{args.family}-{args.size}",
                                                                args.family, args.size))
    log_dir = Path(args.log_dir) if args.log_dir else new_run_dir(cache_dir() / "logs", "up")
    config = dataclasses.replace(config, log_dir=log_dir.resolve())
    say: Say = lambda line: print(f"stage up: {line}", flush=True)  # noqa: E731
    say(f"{config.mode} mode, model {config.model}, logs in {config.log_dir}")
    say(placement_line(config))
    stack = Stack(config, say)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stack.start()
        say(ready_line(stack.url, config.admin_token is not None))
        while (child := stack.exited()) is None:
            time.sleep(HEALTH_POLL_S)
        print(f"stage up: {child.describe()} exited with code {child.proc.returncode}; the end of its log:\n"
              f"{child.log_tail()}", file=sys.stderr)
        return 1
    except StackError as exc:
        print(f"stage up: error: {exc}", file=sys.stderr)
        return 1
    except (_Stopped, KeyboardInterrupt):
        say("stopping")
        return 0
    finally:
        for sig in previous:  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()
        say("stopped")
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)
