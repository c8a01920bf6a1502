"""Configuration of one stage server, of any role: frozen, validated at construction, each error
naming the flag that fixes it. Cheap to import (no torch, no fastapi), so ``stage --help`` is fast.

    ServerConfig            one per process: role, bind address, HTTP limits, admission, debug faults
      .engine  EngineConfig  the model and its KV pool (stages/engine/config.py)
      .limits  ImageLimits   per-image and per-request image limits
      .video   VideoLimits   per-video and per-request video limits, the server's video sampling
      .disagg  DisaggConfig  prefill and decode only: transfer backend, bootstrap, deadlines, EPD cache
      .encoder EncoderConfig encoder only: the embedding cache, batching, claims, deadlines
      .tracing TracingConfig OpenTelemetry traces (telemetry/; off by default: stages/tracing.py)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache.config import DEFAULT_BUDGET_MIB as CACHE_BUDGET_MIB  # --cache-budget-mib default
from cache.config import DEFAULT_TTL_S as CACHE_TTL_S  # --cache-ttl-s default
from cache.config import CacheConfig
from contract.video import OVERRIDABLE
from process.secrets import TOKEN_ENV  # the admin token's environment variable (the router reads the same one)
from stages.engine.config import EngineConfig
from telemetry.config import TracingConfig
from transfer.base import TransferConfig
from transfer.peer_policy import AllowList
from transfer.ucx_listen import ucx_params

ROLES = ("colocated", "prefill", "decode", "encoder", "pd")
DISAGG_ROLES = ("prefill", "decode", "pd")  # pd: a switchable worker, prefill or decode as the router says
MIN_TOKEN_CHARS = 16
TRANSFERS = ("mooncake", "nixl")


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request, all messages together
    max_pixels: int = 4096 * 4096  # width * height of one image
    max_bytes: int = 20 << 20  # encoded size of one image

    def __post_init__(self) -> None:
        flags = {"max_images": "--max-images-per-request", "max_pixels": "--max-image-pixels",
                 "max_bytes": "--max-image-bytes"}
        for name, flag in flags.items():
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class VideoLimits:
    """A server's video limits and its sampling defaults (``contract.video``; ``stages.api.videos``).
    ``sampling``: ``--mm-processor-kwargs``, the server's video settings over the checkpoint's (keys of
    ``contract.video.OVERRIDABLE``), as sorted (key, value) pairs."""

    max_videos: int = 2  # per request, all messages together
    max_bytes: int = 64 << 20  # encoded size of one video (--max-video-mb)
    max_pixels: int = 3840 * 2160  # width * height of the source's frames
    max_seconds: float = 600.0  # frames / fps of the source
    max_frames: int = 256  # sampled frames of one video (a request's num_frames / max_frames may not pass it)
    decode_timeout_s: float = 30.0  # one read of a video (its probe, or its frames)
    sampling: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        flags = {"max_videos": "--max-videos-per-request", "max_bytes": "--max-video-mb",
                 "max_pixels": "--max-video-pixels", "max_seconds": "--max-video-seconds",
                 "max_frames": "--max-video-frames", "decode_timeout_s": "--video-decode-timeout-s"}
        for name, flag in flags.items():
            if not getattr(self, name) > 0 and not (name == "max_videos" and self.max_videos == 0):
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        unknown = sorted({key for key, _ in self.sampling} - set(OVERRIDABLE))
        if unknown:
            raise ValueError(f"--mm-processor-kwargs: unknown key {unknown[0]!r}; the keys are {', '.join(OVERRIDABLE)}")


@dataclass(frozen=True)
class DisaggConfig:
    """What a prefill or decode server adds to a colocated one. Deadlines are per side: the prefill's
    ``pair_timeout_s``, ``prefill_timeout_s`` and ``embedding_timeout_s``; the decode's
    ``pair_timeout_s``, ``accept_timeout_s``, ``kv_timeout_s``, ``peer_idle_timeout_s`` and ``abort_grace_s``.

    Liveness: the prefill sends each decode a heartbeat every ``peer_heartbeat_s`` naming the rooms it
    holds for it; the decode fails a room (504 ``room_timeout`` naming the prefill) once its prefill has
    been silent ``peer_idle_timeout_s``, however long the room's total bound ``kv_timeout_s`` still runs:
    a prefill host that vanished costs seconds, a slow but live prefill is never cut before
    ``kv_timeout_s``. Keep ``peer_idle_timeout_s`` several heartbeats long.

    ``cache`` (``--redis-url``) switches the server to EPD mode: it takes image references
    (``image_ref`` parts) instead of pixels. The prefill reads their embeddings from that cache,
    waiting at most ``embedding_timeout_s`` for encodes in flight (keep it below the decode's
    ``--kv-timeout-s``); the decode needs only the references' sizes and reads no cache."""

    transfer: str = "mooncake"
    transfer_config: TransferConfig = field(default_factory=TransferConfig)
    bootstrap_host: str = "127.0.0.1"  # prefill: where its bootstrap endpoint listens
    bootstrap_port: int = 0  # prefill only; 0 picks a free port
    pair_timeout_s: float = 5.0  # both: a room's other half (HTTP request or KV request) must arrive within this
    prefill_timeout_s: float = 30.0  # prefill: room paired -> KV written and KVReady sent (queueing + forward + write)
    kv_timeout_s: float = 30.0  # decode: KV request sent -> KV ready (queueing + prefill + transfer)
    accept_timeout_s: float = 5.0  # decode: KV request sent -> accepted or rejected by the prefill
    peer_idle_timeout_s: float = 5.0  # decode: fail a room whose prefill sent nothing (no heartbeat) this long
    peer_heartbeat_s: float = 1.0  # prefill: heartbeat to each decode holding rooms, this often
    abort_grace_s: float = 30.0  # decode: an aborted room's blocks wait this long for the prefill's last word
    allowed_bootstrap: tuple[str, ...] = ()  # decode: prefills it may dial (host:port or CIDR); () = loopback
    max_peer_links: int = 64  # decode: cached links to prefills
    peer_link_idle_s: float = 60.0  # decode: close a link to a prefill after this long without a room
    cache: CacheConfig | None = None  # EPD mode (--redis-url): image references instead of pixels
    embedding_timeout_s: float = 20.0  # prefill, EPD: request arrival -> every embedding it references read
    # prefill, EPD: compute the prompt while its images' embeddings come (text before the first image at once,
    # each image's span as its embedding lands); False: wait for all of them first (--no-prefill-overlap)
    prefill_overlap: bool = True
    group: str | None = None  # pairing label the router reads from /server_info (--group)
    admin_token: str | None = field(default=None, repr=False)  # decode, pd: the router's admin calls (--admin-token)

    def __post_init__(self) -> None:
        if self.transfer not in TRANSFERS:
            raise ValueError(f"--transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        if self.transfer == "nixl":
            ucx_params(self.transfer_config)  # UCX listens on --transfer-host's interface: ValueError if none holds it
        for name in ("pair_timeout_s", "prefill_timeout_s", "kv_timeout_s", "accept_timeout_s", "abort_grace_s",
                     "peer_link_idle_s", "embedding_timeout_s", "peer_idle_timeout_s", "peer_heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_peer_links <= 0:
            raise ValueError(f"--max-peer-links must be > 0, got {self.max_peer_links}")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"--bootstrap-port must be in [0, 65535], got {self.bootstrap_port}")
        self.allow_list()  # raises ValueError naming --allowed-bootstrap on a bad pattern
        if self.group is not None and not self.group.strip():
            raise ValueError("--group must not be empty")
        if self.admin_token is not None and len(self.admin_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"--admin-token (or {TOKEN_ENV}) must be at least {MIN_TOKEN_CHARS} characters")

    @property
    def epd(self) -> bool:
        """EPD mode: image references in, embeddings from the cache (``--redis-url`` given)."""
        return self.cache is not None

    def allow_list(self) -> AllowList:
        """A fresh ``AllowList`` of ``--allowed-bootstrap`` (loopback when none is given)."""
        return AllowList.parse(self.allowed_bootstrap) if self.allowed_bootstrap else AllowList()


@dataclass(frozen=True)
class EncoderConfig:
    """What an encoder server adds: the cache it writes (``--redis-url``, ``--cache-budget-mib``,
    ``--cache-ttl-s``, ``--cache-op-timeout-s``), how many images one vision-tower call takes, how long
    its single-flight claims last between renewals, and how long an encode request may take."""

    cache: CacheConfig
    max_batch_images: int = 16
    # a claim lapses this long after its last renewal (renewed every third of it): an encoder that vanished
    # mid-encode frees its images' waiters this soon, so the router's retry on another encoder fits in 10 s
    claim_lease_s: float = 3.0
    encode_timeout_s: float = 60.0  # request arrival -> every image it needs encoded is in the cache
    # sampled frames of one video per vision-tower call (whole temporal patches, at least one): a long video
    # is encoded in chunks and their embeddings concatenated, so it never needs one huge activation
    video_encode_frames: int = 32

    def __post_init__(self) -> None:
        if self.max_batch_images <= 0:
            raise ValueError(f"--max-batch-images must be > 0, got {self.max_batch_images}")
        if self.video_encode_frames <= 0:
            raise ValueError(f"--video-encode-frames must be > 0, got {self.video_encode_frames}")
        for name in ("claim_lease_s", "encode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServerConfig:
    """One stage server. ``disagg`` is required for prefill, decode and pd and refused otherwise;
    ``encoder`` for the encoder and a pd worker in EPD mode (``encodes``)."""

    role: str
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model directory's name
    limits: ImageLimits = field(default_factory=ImageLimits)
    video: VideoLimits = field(default_factory=VideoLimits)
    max_body_mb: float = 64.0  # whole request body; checked from Content-Length and while reading
    max_waiting: int = 256  # requests admitted beyond --max-num-seqs; more get 503 + Retry-After
    stream_keepalive_s: float = 2.0  # an open chat stream silent this long gets an SSE comment (": keep-alive")
    debug_faults: bool = False  # serve /debug/faults (fault points for tests); loopback only
    log_level: str = "info"
    # SIGTERM: new requests refused (503 draining), those in flight finish within this, the rest are aborted
    shutdown_grace_s: float = 30.0
    disagg: DisaggConfig | None = None
    encoder: EncoderConfig | None = None
    tracing: TracingConfig = field(default_factory=TracingConfig)  # no endpoint: off

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if (self.disagg is not None) != (self.role in DISAGG_ROLES):
            raise ValueError(f"a {self.role} server {'needs' if self.disagg is None else 'takes no'} DisaggConfig")
        if (self.encoder is not None) != self.encodes:
            raise ValueError(f"a {self.role} server {'needs' if self.encoder is None else 'takes no'} EncoderConfig")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if not self.max_body_mb > 0:
            raise ValueError(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if not self.stream_keepalive_s > 0:
            raise ValueError(f"--stream-keepalive-s must be > 0, got {self.stream_keepalive_s}")
        if not self.shutdown_grace_s > 0:
            raise ValueError(f"--shutdown-grace-s must be > 0, got {self.shutdown_grace_s}")
        if self.debug_faults and not is_loopback(self.host):
            raise ValueError(f"--debug-faults is refused on a server bound to {self.host!r}: fault points are for "
                             "tests on loopback only (bind 127.0.0.1 or drop --debug-faults)")

    @property
    def encodes(self) -> bool:
        """Runs the encoder's parts: an encoder, or a switchable worker in EPD mode (it can serve as one)."""
        return self.role == "encoder" or (self.role == "pd" and self.disagg is not None and self.disagg.epd)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).resolve().name

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def max_in_flight(self) -> int:
        """Requests the server holds at once: a full batch plus the waiting queue."""
        return self.engine.max_num_seqs + self.max_waiting


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
