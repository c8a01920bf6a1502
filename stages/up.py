"""``stage up``: everything one machine needs behind one OpenAI URL, started and stopped together.

    stage up [--model DIR | --family F --size tiny|small] [--port N] [--mode epd|pd|colocated]
             [--transfer mooncake|nixl] [--redis-url URL] [--kv-cache-mib N] [--log-dir DIR]
             [--admin-token T]

epd (the default): the router computes each image's cache key, sends only missing images to the
encoder and image references with one room to the prefill and the decode (``docs/router.md``).

A mode's stack, in start order: the embedded Redis (epd without ``--redis-url``), the stage servers
(encoder + prefill + decode, prefill + decode, or one colocated server), then the router in front of
them. Every child is ``python -m stages.cli serve ROLE`` on a free loopback port with ``--threads 1``,
pinned to nothing, its output in ``LOG_DIR/ROLE.log`` (by default a new run directory under the
cache dir; only the last 10 runs are kept, ``stages.run_logs``).

Its own children, nobody else: ``--port`` (when not 0) is probed before anything starts, so a port in
use is one line and exit 2 at once; each child gets its own ``EPD_INSTANCE_ID`` (``router.instance``)
and counts as healthy only when ``/health`` answers 200 and ``/server_info`` shows that id, so a
server of another stack answering on a child's port is an error naming the port, never "ready".
``--admin-token`` (or ``EPD_ADMIN_TOKEN``) reaches the router and the stage servers as
``EPD_ADMIN_TOKEN`` in their environment (never on a command line).

``Stack`` is the reusable part (``stage demo`` and benchmarks start the same thing):

    with Stack(StackConfig(model=..., mode="pd", log_dir=...)) as stack:   # start(): all healthy, or StackError
        openai.OpenAI(base_url=stack.base_url, ...)
    # stop(): children in reverse order, SIGTERM then SIGKILL after --stop-timeout-s; Redis last

Process rules: each child leads its own process group (a terminal's Ctrl-C reaches only ``stage up``,
which stops the children in order; stopping signals the whole group, so nothing a child forked
survives it), and gets SIGTERM from the kernel if the thread that started it dies
(``PR_SET_PDEATHSIG``), so a SIGKILLed ``stage up`` orphans nothing. Start a ``Stack`` from the main
thread (the one that lives as long as the stack).

Building the parser imports no torch; the model is generated (first run only) in ``run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from router.cli import TOKEN_ENV
from router.config import MIN_TOKEN_CHARS
from router.instance import INSTANCE_ENV
from router.listen import probe
from stages.config import CACHE_BUDGET_MIB, TRANSFERS
from stages.engine.config import check_device
from stages.model_dir import check_model_dir
from stages.modelgen import FAMILIES, SIZES
from stages.run_logs import new_run_dir

MODES = ("epd", "pd", "colocated")
STAGE_ROLES = {"colocated": ("colocated",), "pd": ("prefill", "decode"), "epd": ("encoder", "prefill", "decode")}
DEFAULT_MODE = "epd"
DEFAULT_SIZE = "tiny"  # of the generated model, for stage up and stage demo alike
HOST = "127.0.0.1"
HEALTH_POLL_S = 0.25
LOG_TAIL_CHARS = 3000
REDIS_HEADROOM = 1.25  # the embedded Redis's maxmemory over the stages' default cache budget

if TYPE_CHECKING:
    from cache.embedded import EmbeddedRedis

Say = Callable[[str], None]


class StackError(RuntimeError):
    """A child could not start (exited, or was not healthy in time); the message names it, its log and
    the log's tail. Raised by ``Stack.start`` after everything already started has been stopped."""


@dataclass(frozen=True)
class StackConfig:
    """What ``Stack`` starts. ``model``: a checkpoint directory (``ensure_model`` makes one); ``port``: the
    router's (0: any free port); ``redis_url``: epd only, an existing Redis instead of the embedded one;
    ``kv_cache_mib``: the KV pool of each server that has one (prefill, decode, colocated; None: their
    default); ``stage_args``: extra flags for every stage server; ``router``: False starts the stages alone.
    ``devices``: ``--device`` of every stage server (one value), or of each in start order (one per
    stage of the mode, e.g. encoder, prefill, decode on three GPUs); () leaves the servers' default.
    ``admin_token``: the router's admin API token (and its stages'), given to every child as
    ``EPD_ADMIN_TOKEN``; None: the admin API is off."""

    model: Path
    log_dir: Path
    mode: str = DEFAULT_MODE
    port: int = 0
    transfer: str = "mooncake"
    redis_url: str | None = None
    threads: int = 1
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    kv_cache_mib: int | None = None
    stage_args: tuple[str, ...] = ()
    router: bool = True
    devices: tuple[str, ...] = ()
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"--transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        if self.redis_url is not None and self.mode != "epd":
            raise ValueError(f"--redis-url is for --mode epd (the embedding cache); --mode {self.mode} has no cache")
        if self.kv_cache_mib is not None and self.kv_cache_mib < 1:
            raise ValueError(f"--kv-cache-mib must be >= 1, got {self.kv_cache_mib}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        for device in self.devices:
            check_device(device)
        if len(self.devices) not in (0, 1, len(STAGE_ROLES[self.mode])):
            raise ValueError(f"--device takes one device for every stage or one per stage of --mode {self.mode} "
                             f"({','.join(STAGE_ROLES[self.mode])}), got {','.join(self.devices)}")
        for name in ("startup_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.admin_token is not None and len(self.admin_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"--admin-token (or {TOKEN_ENV}) must be at least {MIN_TOKEN_CHARS} characters")

    def device_of(self, index: int) -> str | None:
        """The ``--device`` of the stage started ``index``-th, or None for the server's default."""
        if not self.devices:
            return None
        return self.devices[0] if len(self.devices) == 1 else self.devices[index]


@dataclass(frozen=True)
class ChildSpec:
    """One child process: its role, its command line, the port it serves and any other port it binds."""

    role: str
    argv: tuple[str, ...]
    port: int
    other_ports: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def stage_specs(config: StackConfig, redis_url: str | None, ports: Iterator[int]) -> list[ChildSpec]:
    """The stage servers of ``config.mode`` (pure): colocated; prefill, decode; or encoder, prefill,
    decode with ``redis_url``. ``ports`` yields free ports, one per server plus the prefill's bootstrap."""
    common = ("--model", str(config.model), "--host", HOST, "--threads", str(config.threads), *config.stage_args)
    specs = []
    for index, role in enumerate(STAGE_ROLES[config.mode]):
        port, flags, other = next(ports), [], ()
        if role != "encoder" and config.kv_cache_mib is not None:  # the encoder has no KV pool
            flags += ["--kv-cache-mib", str(config.kv_cache_mib)]
        if (device := config.device_of(index)) is not None:
            flags += ["--device", device]
        if role in ("prefill", "decode"):
            flags += ["--transfer", config.transfer]
        if role == "prefill":
            other = (next(ports),)
            flags += ["--bootstrap-port", str(other[0])]
        if config.mode == "epd":
            flags += ["--redis-url", str(redis_url)]
        specs.append(ChildSpec(role, _serve(role, *common, "--port", str(port), *flags), port, other))
    return specs


def router_spec(config: StackConfig, stages: list[ChildSpec], redis_url: str | None, port: int) -> ChildSpec:
    """The router in front of ``stages`` (pure), on ``port``."""
    flags = [f for s in stages for f in (f"--{s.role}", s.url)]
    if config.mode == "epd":
        flags += ["--redis-url", str(redis_url)]
    return ChildSpec("router", _serve("router", "--host", HOST, "--port", str(port), *flags,
                                      "--startup-timeout-s", str(config.startup_timeout_s)), port)


def _serve(role: str, *flags: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "stages.cli", "serve", role, *flags)


@dataclass
class Child:
    """A started child: its spec, process, log file and the ``instance_id`` its ``/server_info`` must show."""

    spec: ChildSpec
    proc: subprocess.Popen
    log_path: Path
    instance_id: str

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self.log_path.exists() else ""

    def describe(self) -> str:
        return f"{self.spec.role} at {self.spec.url} (pid {self.proc.pid}, log {self.log_path})"


@dataclass
class Stack:
    """Starts a mode's processes, waits until all are healthy, stops them. One use: start, then stop
    (``with`` does both). ``say`` gets one line per event (started, healthy, stopping)."""

    config: StackConfig
    say: Say = field(default=lambda line: print(line, flush=True))
    children: list[Child] = field(default_factory=list, init=False)
    redis: EmbeddedRedis | None = field(default=None, init=False)  # when the stack started its own
    redis_url: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        """The router's URL (http://127.0.0.1:PORT); the first stage's when started without a router."""
        if not self.children:
            raise RuntimeError("the stack is not started")
        return next((c.spec.url for c in self.children if c.spec.role == "router"), self.children[0].spec.url)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``url`` + /v1)."""
        return f"{self.url}/v1"

    def urls(self) -> dict[str, str]:
        """Every started child's URL by role (and ``redis``, in epd mode)."""
        out = {c.spec.role: c.spec.url for c in self.children}
        return {**out, "redis": self.redis_url} if self.redis_url else out

    def ports(self) -> list[int]:
        """Every port the stack's own processes listen on (the transfer engines' own ports aside)."""
        ports = [p for c in self.children for p in (c.spec.port, *c.spec.other_ports)]
        return [*ports, self.redis.port] if self.redis is not None else ports

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Stack:
        """Start everything and wait until it is healthy. On any failure, stop what was started and
        raise ``StackError`` (or let KeyboardInterrupt through, after stopping)."""
        if self.children or self.redis is not None:
            raise RuntimeError("a Stack starts once")
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.redis_url = self._redis() if self.config.mode == "epd" else None
            stages = stage_specs(self.config, self.redis_url, _free_ports())
            self._start_all(stages)
            if self.config.router:
                self._start_all([router_spec(self.config, stages, self.redis_url, self.config.port or _free_port())])
        except BaseException:
            self.stop()
            raise
        return self

    def exited(self) -> Child | None:
        """The first child that has exited, if any (a running stack has none)."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        """Stop every child in reverse start order (SIGTERM to its group, SIGKILL after
        ``stop_timeout_s``), then the embedded Redis. Safe to call more than once."""
        while self.children:
            child = self.children[-1]  # popped once stopped: a stop cut short by a signal can be run again
            if child.proc.poll() is None:
                self.say(f"stopping {child.spec.role} (pid {child.proc.pid})")
            _stop_group(child.proc, self.config.stop_timeout_s)
            self.children.pop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def _redis(self) -> str:
        if self.config.redis_url:
            return self.config.redis_url
        from cache.config import MIB
        from cache.embedded import EmbeddedRedis

        self.redis = EmbeddedRedis(int(CACHE_BUDGET_MIB * MIB * REDIS_HEADROOM))
        self.redis.start()
        self.say(f"started redis at {self.redis.url}")
        return self.redis.url

    def _start_all(self, specs: list[ChildSpec]) -> None:
        started = [self._launch(spec) for spec in specs]
        for child in started:
            self.say(f"started {child.describe()}")
        _wait_healthy(started, time.monotonic() + self.config.startup_timeout_s)
        for child in started:
            self.say(f"{child.spec.role} is healthy")

    def _launch(self, spec: ChildSpec) -> Child:
        from cache.embedded import die_with_parent

        log_path = self.config.log_dir / f"{spec.role}.log"
        instance_id = secrets.token_hex(8)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", INSTANCE_ENV: instance_id}
        if self.config.admin_token is not None:
            env[TOKEN_ENV] = self.config.admin_token
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    env=env, process_group=0, preexec_fn=functools.partial(die_with_parent, os.getpid())
                                    if sys.platform == "linux" else None)
        child = Child(spec, proc, log_path, instance_id)
        self.children.append(child)
        return child


def _wait_healthy(children: list[Child], deadline: float) -> None:
    """Until every child is healthy (``_own_and_healthy``); StackError as soon as one exits or another
    process answers on its port, or at ``deadline``."""
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                raise StackError(f"{child.describe()} exited with code {child.proc.returncode} before it was "
                                 f"healthy; the end of its log:\n{child.log_tail()}")
            if _own_and_healthy(child):
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            child = pending[0]
            raise StackError(f"{child.describe()} was not healthy within the startup timeout (--startup-timeout-s); "
                             f"the end of its log:\n{child.log_tail()}")
        if pending:
            time.sleep(HEALTH_POLL_S)


def _own_and_healthy(child: Child) -> bool:
    """Whether ``child`` is healthy: its ``/health`` answers 200 and its ``/server_info`` shows the
    ``instance_id`` it was given. StackError when a server answers there with another id (or none):
    another process holds the child's port."""
    if _get(f"{child.spec.url}/health") is None or (raw := _get(f"{child.spec.url}/server_info")) is None:
        return False
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    found = info.get("instance_id") if isinstance(info, dict) else None
    if found != child.instance_id:
        raise StackError(f"port {child.spec.port} is answered by another process, not the {child.spec.role} "
                         f"stage up started (pid {child.proc.pid}): its /server_info has instance_id {found!r}, "
                         f"not {child.instance_id!r}; stop that process or give another port")
    return True


def _get(url: str) -> bytes | None:
    """The body of ``url``'s answer when it is a 200, else None (no answer yet, or another status)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _stop_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``timeout_s``; then SIGKILL whatever
    is left in the group (a grandchild that outlived its parent)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        _signal_group(proc.pid, sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            continue
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout_s)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is empty (PermissionError: a zombie-only group)
        pass


def _free_port() -> int:
    from stages.cli import free_port

    return free_port(HOST)


def _free_ports() -> Iterator[int]:
    while True:
        yield _free_port()


# --- the command -----------------------------------------------------------------------------
class _Stopped(BaseException):
    """SIGTERM (or SIGINT) reached ``stage up``: unwind to the stop."""


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """``stage up`` flags (no heavy imports)."""
    d = StackConfig(model=Path(), log_dir=Path())
    parser.add_argument("--model", default=None, help="checkpoint directory; default: the generated --family "
                        "model of --size, made on first run under the cache dir")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_vl", help="model family to generate")
    parser.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE, help="model size to generate")
    parser.add_argument("--port", type=int, default=8080, help="the router's port (0: any free port)")
    parser.add_argument("--mode", choices=MODES, default=d.mode,
                        help="epd: encoder + prefill + decode (+ Redis); pd: prefill + decode; colocated: one server")
    parser.add_argument("--transfer", choices=TRANSFERS, default=d.transfer, help="KV transfer (epd, pd)")
    parser.add_argument("--redis-url", default=None, help="epd: this Redis instead of an embedded one")
    parser.add_argument("--log-dir", default=None, help="where every child's log goes; default: a new directory "
                        "under the cache dir")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads of each stage server")
    parser.add_argument("--device", default=None, metavar="DEVICE[,DEVICE...]",
                        help="--device of every stage server, or one per stage in start order (epd: encoder,prefill,"
                             "decode; pd: prefill,decode), e.g. cuda:0,cuda:1,cuda:2; default: each server's (auto)")
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


def cache_dir() -> Path:
    """Where generated models and default log directories live ($XDG_CACHE_HOME/epd-stage)."""
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "epd-stage"


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The validated config of a ``stage up`` command line, its ``log_dir`` still unset. ValueError
    names the flag to change: a bad value, a ``--model`` directory without what the stages load
    (``stages.model_dir``), a ``--port`` in use (``router.listen.PortError``)."""
    config = StackConfig(model=Path(args.model or "."), log_dir=Path(), mode=args.mode, port=args.port,
                         transfer=args.transfer, redis_url=args.redis_url, threads=args.threads,
                         startup_timeout_s=args.startup_timeout_s, stop_timeout_s=args.stop_timeout_s,
                         kv_cache_mib=args.kv_cache_mib, stage_args=tuple(args.stage_arg),
                         devices=tuple(args.device.split(",")) if args.device else (),
                         admin_token=args.admin_token or os.environ.get(TOKEN_ENV) or None)
    if args.model is not None:
        check_model_dir(config.model, tokenizer=True)  # every mode runs a stage with a tokenizer
    if config.port:
        probe(HOST, config.port, "--port")
    return config


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
        from stages.cli import ensure_model

        config = dataclasses.replace(config, model=ensure_model(cache_dir() / f"{args.family}-{args.size}",
                                                                args.family, args.size))
    log_dir = Path(args.log_dir) if args.log_dir else new_run_dir(cache_dir() / "logs", "up")
    config = dataclasses.replace(config, log_dir=log_dir.resolve())
    say: Say = lambda line: print(f"stage up: {line}", flush=True)  # noqa: E731
    say(f"{config.mode} mode, model {config.model}, logs in {config.log_dir}")
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
