"""A mode's whole stack on this machine, behind one OpenAI URL, started and stopped together: what
``stage up`` runs until Ctrl-C, what ``stage demo`` sends one request through, what the benchmarks
measure.

    with Stack(StackConfig(model=..., mode="pd", log_dir=...)) as stack:   # start(): all healthy, or StackError
        openai.OpenAI(base_url=stack.base_url, ...)
    # stop(): children in reverse order, SIGTERM then SIGKILL after stop_timeout_s; Redis last

epd (the default): the router computes each image's cache key, sends only missing images to the
encoder and image references with one room to the prefill and the decode (``docs/router.md``).

A mode's stack, in start order: the embedded Redis (epd without ``redis_url``), the stage servers
(encoder + prefill + decode, prefill + decode, or one colocated server), then the router in front of
them. Every child is ``python -m cli serve ROLE`` on a free loopback port with ``--threads 1``,
pinned to nothing, its output in ``LOG_DIR/ROLE.log``.

Its own children, nobody else: each child gets its own ``EPD_INSTANCE_ID`` (``process.instance``)
and counts as healthy only when ``/health`` answers 200 and ``/server_info`` shows that id
(``stages.launch.health``), so a server of another stack answering on a child's port is an error
naming the port, never "ready". ``admin_token`` reaches the router and the stage servers as
``EPD_ADMIN_TOKEN``, and in epd mode the Redis URL (which may carry a password) as ``EPD_REDIS_URL``,
in their environment, never on a command line (``/proc/PID/cmdline`` is world-readable). In the other
modes ``EPD_REDIS_URL`` is taken out of the children's environment: it would switch a prefill or a
decode to EPD mode.

Each child leads its own process group and dies with the thread that started it
(``process.children``): start a ``Stack`` from the main thread (the one that lives as long as
the stack).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from process.secrets import REDIS_URL_ENV
from stages.config import CACHE_BUDGET_MIB, MIN_TOKEN_CHARS, TOKEN_ENV, TRANSFERS
from stages.engine.config import check_device
from stages.launch.health import HEALTH_POLL_S, ForeignServer, healthy
from process.instance import INSTANCE_ENV, new_instance_id
from process.ports import free_port
from process.children import start_group, stop_process

MODES = ("epd", "pd", "colocated")
STAGE_ROLES = {"colocated": ("colocated",), "pd": ("prefill", "decode"), "epd": ("encoder", "prefill", "decode")}
DEFAULT_MODE = "epd"
HOST = "127.0.0.1"
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
    default); ``prefix_caching``: ``--prefix-caching`` or ``--no-prefix-caching`` on each of those (None:
    their default); ``stage_args``: extra flags for every stage server; ``router``: False starts the stages alone.
    ``devices``: ``--device`` of every stage server (one value), or of each in start order (one per
    stage of the mode, e.g. encoder, prefill, decode on three GPUs); () leaves the servers' default.
    ``memory_shares``: ``--gpu-memory-utilization`` of each stage in start order (None: the server's
    default), for stages sharing a GPU (``stages.launch.placement``); () gives none.
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
    prefix_caching: bool | None = None
    stage_args: tuple[str, ...] = ()
    router: bool = True
    devices: tuple[str, ...] = ()
    memory_shares: tuple[float | None, ...] = ()
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
        if len(self.memory_shares) not in (0, len(STAGE_ROLES[self.mode])):
            raise ValueError(f"memory_shares takes one entry per stage of --mode {self.mode}, got {self.memory_shares}")
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


def stage_specs(config: StackConfig, ports: Iterator[int]) -> list[ChildSpec]:
    """The stage servers of ``config.mode`` (pure): colocated; prefill, decode; or encoder, prefill,
    decode (the Redis URL reaches them in their environment, ``Stack._launch``). ``ports`` yields free
    ports, one per server plus the prefill's bootstrap."""
    common = ("--model", str(config.model), "--host", HOST, "--threads", str(config.threads))
    specs = []
    for index, role in enumerate(STAGE_ROLES[config.mode]):
        port, flags = next(ports), []
        other: tuple[int, ...] = ()
        if role != "encoder" and config.kv_cache_mib is not None:  # the encoder has no KV pool
            flags += ["--kv-cache-mib", str(config.kv_cache_mib)]
        if role != "encoder" and config.prefix_caching is not None:
            flags += ["--prefix-caching" if config.prefix_caching else "--no-prefix-caching"]
        if (device := config.device_of(index)) is not None:
            flags += ["--device", device]
        if config.memory_shares and (share := config.memory_shares[index]) is not None:
            flags += ["--gpu-memory-utilization", str(share)]
        if role in ("prefill", "decode"):
            flags += ["--transfer", config.transfer]
        if role == "prefill":
            other = (next(ports),)
            flags += ["--bootstrap-port", str(other[0])]
        # stage_args last: a flag given there wins over the stack's own (argparse keeps the last)
        specs.append(ChildSpec(role, _serve(role, *common, "--port", str(port), *flags, *config.stage_args), port,
                               other))
    return specs


def router_spec(config: StackConfig, stages: list[ChildSpec], port: int) -> ChildSpec:
    """The router in front of ``stages`` (pure), on ``port`` (epd: the Redis URL in its environment)."""
    flags = [f for s in stages for f in (f"--{s.role}", s.url)]
    return ChildSpec("router", _serve("router", "--host", HOST, "--port", str(port), *flags,
                                      "--startup-timeout-s", str(config.startup_timeout_s)), port)


def _serve(role: str, *flags: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "cli", "serve", role, *flags)


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
            stages = stage_specs(self.config, _free_ports())
            self._start_all(stages)
            if self.config.router:
                self._start_all([router_spec(self.config, stages, self.config.port or free_port(HOST))])
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
            stop_process(child.proc, self.config.stop_timeout_s, group=True)
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
        log_path = self.config.log_dir / f"{spec.role}.log"
        instance_id = new_instance_id()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", INSTANCE_ENV: instance_id}
        if self.config.admin_token is not None:
            env[TOKEN_ENV] = self.config.admin_token
        env.pop(REDIS_URL_ENV, None)
        if self.redis_url is not None:  # epd: every child uses the cache
            env[REDIS_URL_ENV] = self.redis_url
        with open(log_path, "ab") as log_file:
            proc = start_group(spec.argv, log_file, env)
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
    """Whether ``child`` is healthy (``stages.launch.health.healthy`` with its instance id). StackError
    when a server answers there with another id (or none): another process holds the child's port."""
    try:
        return healthy(child.spec.url, child.instance_id)
    except ForeignServer as exc:
        raise StackError(f"port {child.spec.port} is answered by another process, not the {child.spec.role} "
                         f"this stack started (pid {child.proc.pid}): {exc}; stop that process or give another "
                         "port") from None


def _free_ports() -> Iterator[int]:
    while True:
        yield free_port(HOST)
