"""``stage serve ROLE`` for the stage roles (colocated, prefill, decode, encoder, pd): their flags, the
validated ``ServerConfig`` of a command line, and the run: validate, check the model directory and
bind the ports before importing torch, then serve (``stages.server``).

Every role goes through one config (``stages.config``) and one serve path (``stages.server``). Flag
defaults come from the config dataclasses, and building the parsers imports no torch or
transformers, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from cache.config import MIB, CacheConfig
from process.instance import instance_id
from process.secrets import REDIS_URL_ENV, read_secret
from stages.config import (CACHE_BUDGET_MIB, CACHE_TTL_S, DISAGG_ROLES, ROLES, TOKEN_ENV, TRANSFERS, DisaggConfig,
                           EncoderConfig, ImageLimits, ServerConfig, VideoLimits)
from stages.engine.config import (AUTO, BATCHED_TOKENS, CPU_KV_CACHE_MIB, DEVICE_HELP, DTYPES, KV_ALLOCATIONS, PARTS,
                                  TEXT, VISION, EngineConfig)
from stages.generation_defaults import GENERATION_CONFIGS
from stages.model_dir import check_model_dir
from telemetry.config import TracingConfig, add_tracing_args
from transfer.base import TransferConfig

DEFAULT_PORTS = {"colocated": 8000, "prefill": 8100, "decode": 8200, "encoder": 8300, "pd": 8150}
ROLE_HELP = {  # one line each in `stage serve --help`
    "colocated": "encode, prefill and decode in one process",
    "prefill": "prefills and sends the KV to a decode",
    "decode": "takes the KV from a prefill, streams the answer",
    "encoder": "vision tower only: images into the embedding cache",
    "pd": "a prefill or a decode (with --redis-url: or an encoder), as the router says",
}


def add_role_parsers(roles: argparse._SubParsersAction) -> None:
    """``stage serve ROLE`` for every stage role, each running ``run``."""
    for role in ROLES:
        parser = roles.add_parser(role, help=ROLE_HELP[role], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_role_args(parser, role)
        parser.set_defaults(run=run)


def _json_object(text: str) -> dict:
    """A flag's JSON object (argparse turns the ValueError into a one-line usage error)."""
    import json

    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return value


def _defaults(cls: type[DataclassInstance]) -> dict:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def add_engine_args(parser: argparse.ArgumentParser, kv: bool = True) -> None:
    """Flags of ``EngineConfig``, shared by every role that runs a model; ``kv=False`` (the encoder,
    which has no KV pool or scheduler) leaves out the KV and batching flags."""
    d = _defaults(EngineConfig)
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    g.add_argument("--dtype", choices=(AUTO, *DTYPES), default=d["dtype"],
                   help="weights and KV dtype; auto: the checkpoint's dtype on a GPU (float32 if it states none), "
                        "float32 on a CPU (docs/devices.md)")
    g.add_argument("--device", default=d["device"], help=f"where the model, KV pool and embeddings live: {DEVICE_HELP}")
    g.add_argument("--threads", type=int, default=d["threads"], help="torch CPU threads (set on --device cpu only)")
    g.add_argument("--seed", type=int, default=d["seed"], help="torch seed at startup")
    if not kv:
        return
    g.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per KV block")
    g.add_argument("--kv-cache-mib", type=int, default=d["kv_cache_mib"],
                   help=f"KV pool size, wins when given; None: {CPU_KV_CACHE_MIB} MiB on a CPU, from "
                        "--gpu-memory-utilization on a GPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"],
                   help="share of the GPU's memory this server may use (weights, activations, KV pool), as in "
                        "vLLM; the KV pool gets the rest after the weights. Stages sharing one GPU each take their "
                        "own share (two: 0.45 each). Ignored on a CPU and with --kv-cache-mib")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"], help="requests per batch")
    g.add_argument("--max-batched-tokens", type=int, default=d["max_batched_tokens"],
                   help="tokens per step (a decode counts one; longer prompts are prefilled in chunks); None: "
                        f"{BATCHED_TOKENS['cpu']} on a CPU, {BATCHED_TOKENS['cuda']} on a GPU")
    g.add_argument("--kv-allocation", choices=KV_ALLOCATIONS, default=d["kv_allocation"],
                   help="on_demand: KV blocks as tokens are produced, preempting the newest request when the "
                        "pool runs dry; reserve: prompt + max_tokens on admission (the benchmark's baseline)")
    g.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="context length; None: the model's max_position_embeddings")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=d["prefix_caching"],
                   help="reuse the KV of cached prompt prefixes (images keyed by content); a decode server "
                        "computes no prompt and ignores it")
    g.add_argument("--generation-config", choices=GENERATION_CONFIGS, default=d["generation_config"],
                   help="auto: the checkpoint's generation_config.json sampling defaults (temperature, top_p, top_k, "
                        "repetition_penalty, max_new_tokens) apply to every field a request leaves out (vLLM's "
                        "flag); none: the API's own defaults. A prefill and its decodes must agree")


def add_http_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags every server has: bind address, request limits, admission, fault points, logging."""
    limits, server = _defaults(ImageLimits), _defaults(ServerConfig)
    g = parser.add_argument_group("http")
    g.add_argument("--host", default=server["host"], help="address to bind (loopback unless told otherwise)")
    g.add_argument("--port", type=int, default=default_port, help="port to bind (0: any free port)")
    g.add_argument("--served-model-name", default=None, help="model id in the API; None: the model directory's name")
    g.add_argument("--max-images-per-request", type=int, default=limits["max_images"], help="images per request")
    g.add_argument("--max-image-pixels", type=int, default=limits["max_pixels"], help="width * height per image")
    g.add_argument("--max-image-bytes", type=int, default=limits["max_bytes"], help="encoded bytes per image")
    video = _defaults(VideoLimits)
    g.add_argument("--max-videos-per-request", type=int, default=video["max_videos"], help="videos per request")
    g.add_argument("--max-video-mb", type=float, default=video["max_bytes"] / 2**20, help="encoded size per video")
    g.add_argument("--max-video-pixels", type=int, default=video["max_pixels"],
                   help="width * height of a video's frames, as the file states them")
    g.add_argument("--max-video-seconds", type=float, default=video["max_seconds"], help="a video's duration")
    g.add_argument("--max-video-frames", type=int, default=video["max_frames"],
                   help="frames sampled from one video at most (a request's num_frames or max_frames may not pass it)")
    g.add_argument("--video-decode-timeout-s", type=float, default=video["decode_timeout_s"],
                   help="wall time of one read of a video (its header, or its sampled frames); past it: 400")
    g.add_argument("--mm-processor-kwargs", type=_json_object, default={},
                   help="the server's video sampling over the checkpoint's, as JSON (vLLM's flag): keys fps, "
                        "num_frames, min_frames, max_frames, min_pixels, max_pixels; a request's "
                        "mm_processor_kwargs then overrides these within the server's bounds")
    g.add_argument("--max-body-mb", type=float, default=server["max_body_mb"], help="request body size cap (413)")
    g.add_argument("--max-waiting", type=int, default=server["max_waiting"],
                   help="requests held beyond --max-num-seqs; more get 503 with Retry-After")
    g.add_argument("--stream-keepalive-s", type=float, default=server["stream_keepalive_s"],
                   help="a chat stream that has sent nothing this long gets an SSE comment (': keep-alive'), so "
                        "the router's --stream-idle-timeout-s can tell a slow stage from a vanished one")
    g.add_argument("--shutdown-grace-s", type=float, default=server["shutdown_grace_s"],
                   help="on SIGTERM: refuse new requests (503 draining, /health 503), let those in flight finish "
                        "within this, abort the rest with an error, exit 0 (keep it below Kubernetes' "
                        "terminationGracePeriodSeconds)")
    g.add_argument("--debug-faults", action="store_true",
                   help="serve /debug/faults to arm fault points (stages/faults/); refused off loopback")
    g.add_argument("--log-level", default=server["log_level"], choices=["debug", "info", "warning", "error"],
                   help="log level")


def add_disagg_args(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags of ``DisaggConfig`` for one side; each side gets only the deadlines it enforces."""
    d, t = _defaults(DisaggConfig), _defaults(TransferConfig)
    g = parser.add_argument_group("disaggregation")
    g.add_argument("--transfer", choices=TRANSFERS, default=d["transfer"], help="KV transfer backend")
    g.add_argument("--transfer-host", default=None,
                   help="address peers dial for KV transfer; default: --host (must be set when --host is a wildcard)")
    g.add_argument("--transfer-protocol", default=t["protocol"], help="mooncake: tcp or rdma; nixl: tcp, rdma, ucx")
    g.add_argument("--transfer-device", default=t["device"], help="RDMA device names")
    g.add_argument("--transfer-timeout-s", type=float, default=t["timeout_s"], help="deadline of one KV write")
    g.add_argument("--pair-timeout-s", type=float, default=d["pair_timeout_s"],
                   help="a room's other half must arrive within this")
    g.add_argument("--group", default=None, help="pairing label the router may pair by (GET/PUT /admin/pairing)")
    if role in ("prefill", "pd"):
        g.add_argument("--bootstrap-host", default=d["bootstrap_host"], help="bootstrap endpoint address")
        g.add_argument("--bootstrap-port", type=int, default=8998, help="bootstrap endpoint port (0: any)")
        g.add_argument("--prefill-timeout-s", type=float, default=d["prefill_timeout_s"],
                       help="room paired -> KV written and ready sent, at most")
        g.add_argument("--peer-heartbeat-s", type=float, default=d["peer_heartbeat_s"],
                       help="send each decode a heartbeat naming its rooms here this often (keep it well below "
                            "the decodes' --peer-idle-timeout-s)")
    if role in ("prefill", "pd"):  # EPD only (--redis-url)
        g.add_argument("--embedding-timeout-s", type=float, default=d["embedding_timeout_s"],
                       help="EPD mode: request arrival -> every image embedding it references read from the "
                            "cache (waiting for encodes in flight), at most; keep it below the decode's "
                            "--kv-timeout-s")
        g.add_argument("--prefill-overlap", action=argparse.BooleanOptionalAction, default=d["prefill_overlap"],
                       help="EPD mode: compute the prompt while its images are encoded (the text before the "
                            "first image at once, each image's span as its embedding lands)")
    if role in ("decode", "pd"):
        g.add_argument("--admin-token", default=None,
                       help=f"bearer token of the router's calls (/admin/allowed_bootstrap, pd: /role), or "
                            f"--admin-token-file, or the {TOKEN_ENV} environment variable; without one they answer 403")
        g.add_argument("--admin-token-file", default=None, metavar="PATH",
                       help="a file holding --admin-token (one trailing newline is dropped), kept off the command line")
        g.add_argument("--kv-timeout-s", type=float, default=d["kv_timeout_s"],
                       help="KV request sent -> KV ready, at most")
        g.add_argument("--accept-timeout-s", type=float, default=d["accept_timeout_s"],
                       help="KV request sent -> accepted by the prefill, at most")
        g.add_argument("--peer-idle-timeout-s", type=float, default=d["peer_idle_timeout_s"],
                       help="fail a room whose prefill has sent nothing (no heartbeat, no answer) this long; "
                            "--kv-timeout-s stays the room's total bound")
        g.add_argument("--abort-grace-s", type=float, default=d["abort_grace_s"],
                       help="an aborted room's blocks wait this long for the prefill's last word (freed as soon "
                            "as it comes)")
        g.add_argument("--allowed-bootstrap", action="append", default=None, metavar="HOST:PORT|CIDR",
                       help="prefill bootstrap addresses this decode may dial (repeatable; port may be *); "
                            "default: loopback only")
        g.add_argument("--max-peer-links", type=int, default=d["max_peer_links"], help="cached links to prefills")
        g.add_argument("--peer-link-idle-s", type=float, default=d["peer_link_idle_s"],
                       help="close a link to a prefill after this long without a room")


def add_cache_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Flags of the embedding cache (``CacheConfig``): the Redis it lives in, its budget and TTL. Not
    ``required`` (prefill, decode): the URL switches the server to EPD mode. The URL may carry a
    password, so it may also come from ``--redis-url-file`` or ``EPD_REDIS_URL`` (``process.secrets``);
    ``server_config`` checks that an encoder got one."""
    d = _defaults(CacheConfig)
    g = parser.add_argument_group("embedding cache")
    g.add_argument("--redis-url", default=None,
                   help=f"the cache's Redis: redis://[:PASSWORD@]HOST:PORT/DB or unix:///PATH (or --redis-url-file, "
                        f"or the {REDIS_URL_ENV} environment variable)" if required else
                   "EPD mode: take image_ref parts (images encoded by `stage serve encoder` into the cache at this "
                   "Redis) instead of pixels; the prefill reads the embeddings, the decode only the sizes (or "
                   f"--redis-url-file, or the {REDIS_URL_ENV} environment variable, which switch EPD mode on too)")
    g.add_argument("--redis-url-file", default=None, metavar="PATH",
                   help="a file holding --redis-url (one trailing newline is dropped), so its password stays off the "
                        "command line")
    g.add_argument("--cache-budget-mib", type=float, default=CACHE_BUDGET_MIB,
                   help="bytes of embeddings kept; least recently used entries are evicted past it")
    g.add_argument("--cache-ttl-s", type=float, default=CACHE_TTL_S, help="drop an entry unused this long")
    g.add_argument("--cache-op-timeout-s", type=float, default=d["op_timeout_s"], help="deadline of each Redis call")
    g.add_argument("--claim-check-s", type=float, default=d["claim_check_s"],
                   help="a wait on an image being encoded re-checks its claim this often (how late it notices an "
                        "encoder that vanished, after the claim lapsed)")


def redis_url(args: argparse.Namespace) -> str | None:
    """The cache's Redis URL of a command line: ``--redis-url``, ``--redis-url-file`` or
    ``EPD_REDIS_URL`` (``process.secrets.read_secret``); None for a role without cache flags or when
    none is given. SecretError (a ValueError) names the flag."""
    if not hasattr(args, "redis_url"):
        return None
    return read_secret(args.redis_url, args.redis_url_file, flag="--redis-url", env=REDIS_URL_ENV, environ=os.environ)


def admin_token(args: argparse.Namespace) -> str | None:
    """``--admin-token``, ``--admin-token-file`` or ``EPD_ADMIN_TOKEN`` (decode, pd); None otherwise."""
    if not hasattr(args, "admin_token"):
        return None
    return read_secret(args.admin_token, args.admin_token_file, flag="--admin-token", env=TOKEN_ENV, environ=os.environ)


def cache_config(args: argparse.Namespace, url: str) -> CacheConfig:
    return CacheConfig(url=url, budget_bytes=int(args.cache_budget_mib * MIB), ttl_s=args.cache_ttl_s,
                       op_timeout_s=args.cache_op_timeout_s, claim_check_s=args.claim_check_s)


def add_encoder_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``EncoderConfig`` (the cache flags come from ``add_cache_args``)."""
    d = _defaults(EncoderConfig)
    g = parser.add_argument_group("encoder")
    g.add_argument("--max-batch-images", type=int, default=d["max_batch_images"], help="images per vision-tower call")
    g.add_argument("--claim-lease-s", type=float, default=d["claim_lease_s"],
                   help="an image's single-flight claim lapses this long after its last renewal")
    g.add_argument("--encode-timeout-s", type=float, default=d["encode_timeout_s"],
                   help="an encode request's images must be in the cache within this")
    g.add_argument("--video-encode-frames", type=int, default=d["video_encode_frames"],
                   help="a video's sampled frames per vision-tower call (whole temporal patches, at least one): "
                        "longer videos are encoded in chunks")


def add_role_args(parser: argparse.ArgumentParser, role: str) -> None:
    """Every flag of ``stage serve ROLE``."""
    add_engine_args(parser, kv=role != "encoder")
    add_http_args(parser, default_port=DEFAULT_PORTS[role])
    add_tracing_args(parser)
    if role in DISAGG_ROLES:
        add_disagg_args(parser, role)
    if role in ("prefill", "decode", "pd"):
        add_cache_args(parser, required=False)
    if role == "encoder":
        add_cache_args(parser)
    if role in ("encoder", "pd"):  # pd: the encoder's flags apply when --redis-url makes it a possible encoder
        add_encoder_args(parser)


def role_parts(role: str, epd: bool) -> tuple[str, ...]:
    """The halves of the model a role loads (``stages.loading``): the encoder the vision half; decode,
    and prefill in EPD mode, the text half; colocated, a PD prefill (which encodes) and a switchable
    worker (which may serve as any of them) both."""
    if role == "encoder":
        return (VISION,)
    if role == "decode" or (role == "prefill" and epd):
        return (TEXT,)
    return PARTS


_ENGINE_FLAGS = ("dtype", "device", "block_size", "kv_cache_mib", "gpu_memory_utilization", "max_num_seqs",
                 "max_batched_tokens", "max_model_len",
                 "threads", "seed", "prefix_caching", "kv_allocation", "generation_config")


def server_config(args: argparse.Namespace, role: str) -> ServerConfig:
    """The validated config of a ``stage serve ROLE`` command line; ValueError names the flag to change."""
    url = redis_url(args)
    if role == "encoder" and url is None:
        raise ValueError(f"the encoder needs its cache's Redis: give --redis-url, --redis-url-file or {REDIS_URL_ENV}")
    epd = role in DISAGG_ROLES and url is not None
    engine = EngineConfig(model=args.model, parts=role_parts(role, epd),
                          **{name: getattr(args, name) for name in _ENGINE_FLAGS if hasattr(args, name)})
    disagg = None
    if role in DISAGG_ROLES:
        side = {name: getattr(args, name) for name in (
            "bootstrap_host", "bootstrap_port", "prefill_timeout_s", "kv_timeout_s", "accept_timeout_s",
            "abort_grace_s", "max_peer_links", "peer_link_idle_s", "embedding_timeout_s", "prefill_overlap", "group",
            "peer_idle_timeout_s", "peer_heartbeat_s")
            if hasattr(args, name)}
        side["admin_token"] = admin_token(args)
        disagg = DisaggConfig(
            transfer=args.transfer, pair_timeout_s=args.pair_timeout_s,
            cache=cache_config(args, url) if url is not None and epd else None,
            transfer_config=TransferConfig(host=args.transfer_host or args.host, protocol=args.transfer_protocol,
                                           device=args.transfer_device, timeout_s=args.transfer_timeout_s),
            allowed_bootstrap=tuple(getattr(args, "allowed_bootstrap", None) or ()), **side)
    encoder = None
    if role == "encoder" or (role == "pd" and url is not None):
        encoder = EncoderConfig(cache=cache_config(args, str(url)), max_batch_images=args.max_batch_images,
                                claim_lease_s=args.claim_lease_s, encode_timeout_s=args.encode_timeout_s,
                                video_encode_frames=args.video_encode_frames)
    config = ServerConfig(
        role=role, engine=engine, host=args.host, port=args.port, served_model_name=args.served_model_name,
        limits=ImageLimits(args.max_images_per_request, args.max_image_pixels, args.max_image_bytes),
        video=VideoLimits(args.max_videos_per_request, int(args.max_video_mb * 2**20), args.max_video_pixels,
                          args.max_video_seconds, args.max_video_frames, args.video_decode_timeout_s,
                          tuple(sorted(args.mm_processor_kwargs.items()))),
        max_body_mb=args.max_body_mb, max_waiting=args.max_waiting, debug_faults=args.debug_faults,
        stream_keepalive_s=args.stream_keepalive_s, log_level=args.log_level, shutdown_grace_s=args.shutdown_grace_s,
        disagg=disagg, encoder=encoder)
    return dataclasses.replace(config, tracing=tracing_config(args, role, config.model_name))


def tracing_config(args: argparse.Namespace, role: str, model: str) -> TracingConfig:
    """``--otlp-traces-endpoint`` / ``--otlp-traces-sample-ratio`` (``telemetry.config``): the service
    ``epd-{role}``, this process's start id (``process.instance``, as its ``/server_info`` shows) and the
    served model's name."""
    return TracingConfig.from_args(args, role, instance_id(), model)


def run(args: argparse.Namespace) -> int:
    """``stage serve ROLE``: validate the flags, check that every address it binds or hands out is this
    machine's (``stages.addresses``), check the model directory and take the ports before importing
    torch, so those mistakes are one line on stderr and exit code 2, at once."""
    from stages.addresses import check_addresses
    from stages.server import claim_ports, serve

    try:
        config = server_config(args, args.role)
        check_addresses(config, "--transfer-host" if getattr(args, "transfer_host", None) else "--host")
        check_model_dir(config.engine.model, tokenizer=args.role != "encoder")
        sock = claim_ports(config)  # process.ports.PortError (a ValueError) names the port and its flag
        config.engine.torch_device  # noqa: B018 - resolves --device (imports torch): no GPU there is an error here
    except ValueError as exc:  # the message names the flag to change
        print(f"stage serve {args.role}: error: {exc}", file=sys.stderr)
        return 2
    serve(config, sock)
    return 0
