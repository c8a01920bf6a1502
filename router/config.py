"""Configuration of the router: frozen, validated at construction, each error naming the flag that
fixes it. Cheap to import (no aiohttp, no torch), so ``stage --help`` stays fast.

The mode follows from the roles given: ``--colocated`` alone is ``colocated``; ``--prefill`` with
``--decode`` is ``pd``; ``--encoder`` added to those is ``epd``. A role is given by its URL flag or by a
``--discover ROLE=dns://...`` source (``router.fleet.dns_source``), or both.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlsplit

from cache.config import DEFAULT_TTL_S
from router.fleet.dns_source import DnsSource, parse_discover, parse_nameserver
from router.plan.policy import PrefixSettings
from telemetry.config import TracingConfig

MODES = ("colocated", "pd", "epd")
POLICIES = ("round_robin", "least_load")
ENCODER_POLICIES = (*POLICIES, "cache_aware")
PREFIX_POLICIES = (*POLICIES, "prefix_aware")  # the roles that compute a prompt: prefill, colocated
ROLE_POLICIES = {"prefill": PREFIX_POLICIES, "decode": POLICIES, "colocated": PREFIX_POLICIES,
                 "encoder": ENCODER_POLICIES}
ROLES = ("encoder", "prefill", "decode", "colocated")
LOCAL_ENCODE = ("never", "auto", "always")
AUTO_RATIO_ROLES = (("encoder", "prefill", "decode"), ("prefill", "decode"))  # --auto-ratio-roles choices
MODE_ROLES = {"colocated": ("colocated",), "pd": ("prefill", "decode"), "epd": ("encoder", "prefill", "decode")}
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    encoder: tuple[str, ...] = ()
    # ROLE=dns://NAME:PORT or ROLE=dns+srv://NAME, followed by router.fleet.dns_watch (docs/router.md)
    discover: tuple[str, ...] = ()
    discover_interval_s: float = 5.0  # between two resolutions of every --discover source
    discover_nameserver: str | None = None  # IP[:PORT] asked instead of the system's resolv.conf
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None  # epd: the embedding cache index
    cache_ttl_s: float = DEFAULT_TTL_S  # epd: an entry the router finds is kept this long (same as the stages')
    cache_op_timeout_s: float = 2.0  # epd: deadline of each Redis call the router makes
    claim_lease_s: float = 3.0  # epd: a claim taken for an encoder lapses after this unless the encoder renews it
    policy_prefill: str = "round_robin"
    policy_decode: str = "least_load"
    policy_colocated: str = "least_load"
    policy_encoder: str = "cache_aware"
    # epd: a request's images encoded by its own prefill (a switchable worker in EPD mode, which publishes an
    # encoder id) instead of an encoder: never, always, or auto (router.plan.local_encode.encode_locally)
    local_encode: str = "auto"
    local_encode_queue: int = 2  # auto: when every eligible encoder has at least this many encode calls in flight
    # prefix_aware (router.plan.policy.PrefixAware; docs/router.md, "Prefix-aware routing")
    prefix_cache_threshold: float = PrefixSettings.cache_threshold
    prefix_balance_abs: int = PrefixSettings.balance_abs
    prefix_balance_rel: float = PrefixSettings.balance_rel
    prefix_tree_nodes: int = PrefixSettings.tree_nodes
    max_body_mb: float = 64.0  # whole request body; checked from Content-Length and while reading
    max_in_flight: int = 1024  # requests held at once; beyond: 503 + Retry-After
    upstream_timeout_s: float = 600.0  # deadline of one upstream call, from sending to its last byte
    connect_timeout_s: float = 5.0  # deadline of opening a connection to a stage
    # an open upstream stream that sends no byte (keep-alive comments included) this long is cut: the stages
    # send ": keep-alive" after --stream-keepalive-s (2 s) of silence, so only a stalled or vanished stage is
    stream_idle_timeout_s: float = 6.0
    # TCP keepalive and TCP_USER_TIMEOUT on every upstream connection: a stage's host that stops answering at
    # the TCP level (no ACK to a probe or to data) fails the call after about this long, stream or not
    upstream_host_timeout_s: float = 5.0
    retries: int = 1  # fresh attempts after a failure that reached the client with nothing
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    # consecutive health checks that time out before a worker is marked unhealthy: a stage busy on a
    # saturated machine answers /health late, and one late answer must not take the only decode away
    # (a refused connection or an error answer marks it at once; a stalled stream, the idle deadline)
    health_timeouts: int = 3
    breaker_failures: int = 3  # consecutive failures that open a worker's circuit
    breaker_cooldown_s: float = 10.0  # open -> half-open after this long
    startup_timeout_s: float = 60.0  # wait this long for the workers' first answers at startup
    allowed_image_hosts: tuple[str, ...] = ()  # hosts (or host:port) http(s) image URLs may name
    image_fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20  # one fetched image
    max_images_per_request: int = 16
    max_videos_per_request: int = 2
    max_video_mb: float = 64.0  # one fetched video (a data: URL's own bound is the stages' published one)
    log_level: str = "info"
    # admin API (docs/admin.md): off without a token; EPD_ADMIN_TOKEN is read by the CLI
    admin_token: str | None = field(default=None, repr=False)
    room_history: int = 1024  # rooms whose timelines the router keeps
    ratio_window_s: float = 60.0  # demand, utilization and capacity are measured over this window
    auto_ratio_interval_s: float = 0.0  # apply the recommended split this often (0: never)
    auto_ratio_roles: tuple[str, ...] = AUTO_RATIO_ROLES[0]  # the roles the loop moves workers between
    drain_timeout_s: float = 120.0  # a switch or a waiting drain gives up on a worker still busy after this
    shutdown_grace_s: float = 30.0  # SIGTERM: stop accepting, let requests in flight finish within this, exit 0
    # this process's start id in /server_info; `stage serve router` gives its own (EPD_INSTANCE_ID when its
    # starter set one, process.instance), so a starter can tell its router from another on the port
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    # OpenTelemetry traces (--otlp-traces-endpoint, --otlp-traces-sample-ratio; off without an endpoint)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        for role in ROLES:
            urls = getattr(self, role)
            for url in urls:
                check_worker_url(url, role)
            if len(set(urls)) != len(urls):
                raise ValueError(f"--{role} names the same URL twice: {sorted(urls)}")
        self._check_discover()
        self._check_roles()
        for role, choices in ROLE_POLICIES.items():
            if getattr(self, f"policy_{role}") not in choices:
                raise ValueError(f"--policy-{role} must be one of {choices}, got {getattr(self, f'policy_{role}')!r}")
        self._check_prefix()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.upstream_host_timeout_s >= 2:
            raise ValueError(f"--upstream-host-timeout-s must be >= 2, got {self.upstream_host_timeout_s}")
        for name in ("max_body_mb", "upstream_timeout_s", "connect_timeout_s", "stream_idle_timeout_s",
                     "health_interval_s",
                     "health_timeout_s", "breaker_cooldown_s", "startup_timeout_s", "image_fetch_timeout_s",
                     "max_video_mb", "ratio_window_s", "drain_timeout_s", "discover_interval_s", "cache_ttl_s", "cache_op_timeout_s",
                     "claim_lease_s", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if tuple(self.auto_ratio_roles) not in AUTO_RATIO_ROLES:
            raise ValueError(f"--auto-ratio-roles must be encoder,prefill,decode or prefill,decode (encoders fixed), "
                             f"got {','.join(self.auto_ratio_roles)!r}")
        if self.local_encode not in LOCAL_ENCODE:
            raise ValueError(f"--local-encode must be one of {LOCAL_ENCODE}, got {self.local_encode!r}")
        for name in ("max_in_flight", "breaker_failures", "health_timeouts", "max_image_bytes", "max_images_per_request",
                     "max_videos_per_request", "room_history", "local_encode_queue"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.admin_token is not None and len(self.admin_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"--admin-token (or EPD_ADMIN_TOKEN) must be at least {MIN_TOKEN_CHARS} characters")
        if self.auto_ratio_interval_s < 0:
            raise ValueError(f"--auto-ratio-interval-s must be >= 0 (0: off), got {self.auto_ratio_interval_s}")
        if self.retries < 0:
            raise ValueError(f"--retries must be >= 0, got {self.retries}")
        for host in self.allowed_image_hosts:
            if not host or "/" in host or host != host.strip():
                raise ValueError(f"--allowed-image-hosts takes host or host:port entries, got {host!r}")

    def _check_prefix(self) -> None:
        if not 0 <= self.prefix_cache_threshold <= 1:
            raise ValueError(f"--prefix-cache-threshold must be in [0, 1], got {self.prefix_cache_threshold}")
        if self.prefix_balance_abs < 0:
            raise ValueError(f"--prefix-balance-abs must be >= 0, got {self.prefix_balance_abs}")
        if not self.prefix_balance_rel >= 1:
            raise ValueError(f"--prefix-balance-rel must be >= 1, got {self.prefix_balance_rel}")
        if self.prefix_tree_nodes <= 0:
            raise ValueError(f"--prefix-tree-nodes must be > 0, got {self.prefix_tree_nodes}")

    def _check_discover(self) -> None:
        labels = [(s.role, s.label) for s in self.dns_sources]  # each parsed: ValueError names --discover
        if len(set(labels)) != len(labels):
            raise ValueError(f"--discover names the same source twice: {sorted(self.discover)}")
        if self.discover_nameserver is not None:
            parse_nameserver(self.discover_nameserver)

    def _check_roles(self) -> None:
        given = {role: self.given(role) for role in ROLES}
        if given["colocated"] and (given["prefill"] or given["decode"] or given["encoder"]):
            raise ValueError("--colocated cannot be mixed with --prefill, --decode or --encoder: "
                             "a router runs one mode")
        if not (given["colocated"] or given["prefill"] or given["decode"]):
            raise ValueError("no workers: give --colocated URL, or --prefill URL and --decode URL "
                             "(or --discover ROLE=dns://NAME:PORT for each)")
        if given["prefill"] != given["decode"]:
            missing = "--decode" if given["prefill"] else "--prefill"
            raise ValueError(f"pd mode needs both --prefill and --decode workers; {missing} is missing")
        if self.mode == "epd" and not self.redis_url:
            raise ValueError("epd mode (--encoder given) needs --redis-url, the embedding cache index")
        if self.redis_url is not None and urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("--redis-url must start with redis://, rediss:// or unix://")

    @cached_property
    def mode(self) -> str:
        """colocated, pd or epd (read on every request: computed once, the config being frozen)."""
        if self.given("colocated"):
            return "colocated"
        return "epd" if self.given("encoder") else "pd"

    @cached_property
    def dns_sources(self) -> tuple[DnsSource, ...]:
        """The ``--discover`` sources, parsed (once)."""
        return tuple(parse_discover(text, ROLES) for text in self.discover)

    def given(self, role: str) -> bool:
        """Whether ``role`` has workers: by URL (``--ROLE``) or by a ``--discover`` source."""
        return bool(getattr(self, role)) or any(s.role == role for s in self.dns_sources)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def max_video_bytes(self) -> int:
        """``--max-video-mb`` as bytes: one fetched video, at most."""
        return int(self.max_video_mb * (1 << 20))

    def workers(self) -> list[tuple[str, str]]:
        """Every (role, url) this router was started with, encoders first."""
        return [(role, url) for role in ROLES for url in getattr(self, role)]

    def policy(self, role: str) -> str:
        return getattr(self, f"policy_{role}")

    @property
    def prefix_settings(self) -> PrefixSettings:
        return PrefixSettings(self.prefix_cache_threshold, self.prefix_balance_abs, self.prefix_balance_rel,
                              self.prefix_tree_nodes)


def check_worker_url(url: str, role: str) -> None:
    """A worker URL is ``http://host:port`` (no path, query or trailing slash); ValueError names ``--ROLE``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a bad port or IPv6 literal
        raise ValueError(f"--{role} takes http://host:port URLs, got {url!r}") from None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"--{role} takes http://host:port URLs, got {url!r}")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"--{role} takes http://host:port URLs without a path, got {url!r}")
