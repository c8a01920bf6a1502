"""Tracing's configuration: frozen, validated at construction, each error naming the flag that fixes
it. Cheap to import (nothing of ``opentelemetry``), so a server with tracing off pays nothing.

Flags (vLLM's names), added by ``add_tracing_args`` to a server's parser and read back by
``TracingConfig.from_args``:
    --otlp-traces-endpoint URL      OTLP over HTTP/protobuf, e.g. http://127.0.0.1:4318/v1/traces;
                                    default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT if set, else tracing off
    --otlp-traces-sample-ratio R    0 < R <= 1 (default 1.0): the share of new traces kept
                                    (ParentBased(TraceIdRatioBased(R)): the router decides, the stages
                                    follow the incoming ``traceparent``'s sampled flag)
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ROLES = ("router", "encoder", "prefill", "decode", "colocated", "pd")


@dataclass(frozen=True)
class TracingConfig:
    """``endpoint`` None: tracing off. ``role`` names the service (``epd-{role}``); ``instance_id`` is
    the process's start id (``process.instance``: the caller passes it, this package imports nothing of
    ours); ``model`` the served model's name, as ``epd.model`` on every span's resource."""

    endpoint: str | None = None
    sample_ratio: float = 1.0
    role: str = "router"
    instance_id: str = ""
    model: str = ""
    export_timeout_s: float = 10.0  # one export request to the collector, at most

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            parts = urlsplit(self.endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL with a host, e.g. "
                                 f"http://127.0.0.1:4318/v1/traces (got {self.endpoint!r})")
        ratio = self.sample_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) \
                or not 0 < ratio <= 1:
            raise ValueError(f"--otlp-traces-sample-ratio must be a number in (0, 1] (got {ratio!r})")
        if self.role not in ROLES:
            raise ValueError(f"tracing role must be one of {', '.join(ROLES)} (got {self.role!r})")
        if not self.export_timeout_s > 0:
            raise ValueError(f"export_timeout_s must be > 0 (got {self.export_timeout_s!r})")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str, instance_id: str, model: str) -> TracingConfig:
        """The config of ``add_tracing_args``'s flags as parsed, the endpoint defaulting to the
        environment's (``resolve_endpoint``)."""
        return cls(endpoint=resolve_endpoint(args.otlp_traces_endpoint), sample_ratio=args.otlp_traces_sample_ratio,
                   role=role, instance_id=instance_id, model=model)


def resolve_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The flag when given, else ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` when set and not empty, else
    None (off). Not validated here: ``TracingConfig`` does."""
    if flag:
        return flag
    return environ.get(ENDPOINT_ENV) or None


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    """The two tracing flags, in a group of their own."""
    g = parser.add_argument_group("tracing (OpenTelemetry, off by default)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help=f"OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces "
                        f"(default: ${ENDPOINT_ENV} if set, else tracing off)")
    g.add_argument("--otlp-traces-sample-ratio", type=float, default=1.0, metavar="R",
                   help="share of new traces kept, 0 < R <= 1; a request with a traceparent follows "
                        "its sampled flag (default 1.0)")
