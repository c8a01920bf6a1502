"""Content keys of the embedding cache. Pure: no I/O.

A key names one image as seen by one vision model: ``image_key(bytes, fingerprint)`` is the blake3
hash of the image bytes, keyed by the model's ``vision_fingerprint``. The same bytes under two
fingerprints give unrelated keys, so two models (or one model at two dtypes, or two fine-tunes of
one architecture) never share an entry.

Who computes what: the encoder computes its fingerprint once at start-up (it loads the vision tower
and the image processor) and publishes it; whoever turns image bytes into keys (the router, or the
encoder itself) calls ``image_key`` with that fingerprint. Keys are 64 lowercase hex digits;
``check_key`` rejects anything else before it reaches Redis.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import blake3

if TYPE_CHECKING:
    import torch

KEY_HEX_DIGITS = 64
_KEY_RE = re.compile(r"[0-9a-f]{64}")

# Config keys that say where or with which release a config was saved, not what the model computes.
_IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                                  "processor_class"})


def check_key(key: str) -> str:
    """Return ``key`` if it is a cache key (64 lowercase hex digits), else raise ValueError."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"not an image cache key (want {KEY_HEX_DIGITS} lowercase hex digits): {key!r:.80}")
    return key


def image_key(image_bytes: bytes, vision_fingerprint: str) -> str:
    """The cache key of ``image_bytes`` (the encoded file as received) under a model's fingerprint."""
    check_key(vision_fingerprint)
    return blake3.blake3(image_bytes, key=bytes.fromhex(vision_fingerprint)).hexdigest()


def video_key(video_bytes: bytes, sampling: Mapping[str, Any], vision_fingerprint: str) -> str:
    """The cache key of a video: its bytes as received and the sampling that turns them into frames
    (``contract.video.VideoSampling.to_json()``, resolved: the same frames give the same key however the
    request spelled them), under a model's fingerprint. Never equal to an ``image_key``: the sampling's
    canonical JSON and a NUL byte come first."""
    check_key(vision_fingerprint)
    hasher = blake3.blake3(key=bytes.fromhex(vision_fingerprint))
    hasher.update(json.dumps(dict(sampling), sort_keys=True, separators=(",", ":")).encode() + b"\0")
    hasher.update(video_bytes)
    return hasher.hexdigest()


def vision_fingerprint(vision_config: Mapping[str, Any], processor_config: Mapping[str, Any], *,
                       dtype: str, weights: str) -> str:
    """A stable 64-hex-digit identity of what turns image bytes into embeddings.

    ``vision_config``: the vision tower's config plus whatever else shapes the embedding (for LLaVA,
    the top-level projector and feature-layer settings). ``processor_config``: the image processor's
    config. ``dtype``: the dtype the encoder computes in. ``weights``: a digest of the vision tower
    and projector weights (``weights_digest``), so two checkpoints with equal configs differ.
    Key order and save-location keys (``_name_or_path``, ``transformers_version``, ...) do not count.
    """
    canonical = json.dumps({"vision": _strip(vision_config), "processor": _strip(processor_config),
                            "dtype": dtype, "weights": weights},
                           sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(canonical.encode()).hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """blake3 over every tensor's name, dtype, shape and bytes, in name order (64 hex digits).

    Call with ``module.state_dict().items()`` of the vision tower and projector once at load time.
    """
    import torch  # here, so that computing keys (the router) does not import torch

    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        hasher.update(f"{name}|{flat.dtype}|{list(tensor.shape)}|".encode())
        hasher.update(flat.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _strip(v) for k, v in value.items() if k not in _IGNORED_CONFIG_KEYS}
    if isinstance(value, list | tuple):
        return [_strip(v) for v in value]
    return value
