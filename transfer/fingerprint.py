"""The compatibility fingerprint of a room's two halves: what must be equal on a prefill (P) and a
decode (D) for P's KV to be valid in D's blocks, and the checks that name the setting to change.

    Fingerprint(model=..., dtype=..., block_size=..., ...)      model_identity(model_type, config) -> "qwen2_vl-1a2b..."
    check_version(mine, theirs) -> str | None                     check_compatible(mine, theirs) -> str | None

Pure: no I/O. A ``KVRequest`` (``transfer.messages``) carries D's fingerprint; P refuses one that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from transfer.base import MEMORY_KINDS

# Keys of a Hugging Face config that name where or how it was saved, not what the model is.
_CONFIG_KEYS_IGNORED = frozenset(
    {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype"}
)


@dataclass(frozen=True)
class Fingerprint:
    """What must be equal on P and D for P's KV to be valid in D's blocks.

    ``model`` is a name- and path-independent identity of the checkpoint (see ``model_identity``);
    ``backend`` is the transfer backend's registry name (the request's descriptor is only meaningful
    to the same backend); ``block_bytes`` is the size of one block of the registered KV pool, which
    catches pool layouts that differ even when every shape field agrees.

    ``memory`` is where the KV pool lives: "DRAM" (``--device cpu``) or "VRAM" (a GPU; the GPU's
    index may differ between P and D). Mixed pairs (a GPU prefill feeding a CPU decode, or the
    reverse) are refused here, naming ``--device``: seeded sampling carries over from P to D by
    replaying the generator's draws, and torch's CPU and CUDA generators draw different numbers
    from one seed, so a mixed pair could not keep its promise of colocated output.

    ``generation_defaults`` is the sampling defaults both apply to the fields a request leaves out
    (``--generation-config``; canonical JSON, ``"{}"`` for none): P samples the first token and D the
    rest, so a pair that differs would sample one answer two ways. A peer too old to send it applies
    none, which is what its default says.
    """

    model: str
    backend: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    memory: str = "DRAM"
    generation_defaults: str = "{}"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "memory":
                if value not in MEMORY_KINDS:
                    raise ValueError(f"Fingerprint.memory must be one of {MEMORY_KINDS}, got {value!r}")
            elif f.name == "generation_defaults":
                if not isinstance(value, str):
                    raise ValueError(f"Fingerprint.generation_defaults must be a string, got {value!r}")
            elif f.name in ("model", "backend", "dtype"):
                if not (isinstance(value, str) and value):
                    raise ValueError(f"Fingerprint.{f.name} must be a non-empty string, got {value!r}")
            elif not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"Fingerprint.{f.name} must be a positive int, got {value!r}")


def model_identity(model_type: str, config: Mapping[str, Any]) -> str:
    """``"<model_type>-<16 hex digits>"``: a hash of the model config without names, paths, dtype.

    Two copies of one checkpoint at different paths give the same identity; a checkpoint with any
    architectural difference (layers, heads, vocab, rope settings, ...) gives another.
    """

    def strip(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): strip(v) for k, v in value.items() if k not in _CONFIG_KEYS_IGNORED}
        if isinstance(value, list | tuple):
            return [strip(v) for v in value]
        return value

    canonical = json.dumps(strip(config), sort_keys=True, separators=(",", ":"), default=str)
    return f"{model_type}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


_SAME_CHECKPOINT = "serve the same checkpoint (--model) with the same release on {a} and {b}"
# (field, what to call it, how to fix it); checked in this order.
_FIELD_HINTS: tuple[tuple[str, str, str], ...] = (
    ("model", "model differs", "serve the same checkpoint (--model) on {a} and {b}"),
    ("backend", "transfer backend differs", "start both with the same --transfer"),
    ("memory", "KV memory differs", "run {a} and {b} on the same kind of device (--device cpu on both, or "
                                    "--device cuda[:N] on both)"),
    ("dtype", "KV dtype differs", "start both with the same --dtype"),
    ("block_size", "block size differs", "start both with the same --block-size"),
    ("num_layers", "layer count differs", _SAME_CHECKPOINT),
    ("num_kv_heads", "KV head count differs", _SAME_CHECKPOINT),
    ("head_dim", "head dim differs", _SAME_CHECKPOINT),
    ("block_bytes", "KV block bytes differ", "run the same release on {a} and {b} (KV pool layouts differ)"),
    ("generation_defaults", "sampling defaults differ", "start both with the same --generation-config (and the "
                                                        "same generation_config.json in the checkpoint)"),
)
# A different model already explains different shapes; do not list those too.
_IMPLIED_BY_MODEL = frozenset({"num_layers", "num_kv_heads", "head_dim", "block_bytes"})


def check_version(mine: int, theirs: int, *, mine_role: str = "prefill", theirs_role: str = "decode") -> str | None:
    """None when the protocol versions match, else an error naming the fix."""
    if mine == theirs:
        return None
    return (
        f"protocol version differs: {mine_role} {mine}, {theirs_role} {theirs}; "
        f"run the same release on {mine_role} and {theirs_role}"
    )


def check_compatible(
    mine: Fingerprint, theirs: Fingerprint, *, mine_role: str = "prefill", theirs_role: str = "decode"
) -> str | None:
    """None when P's KV fits D's pool, else one error per differing field, joined by `` | ``.

    Each error names the field, both settings and the setting to change, e.g.
    ``block size differs: prefill 16, decode 32; start both with the same --block-size``.
    """
    errors = []
    model_differs = mine.model != theirs.model
    for name, what, fix in _FIELD_HINTS:
        a, b = getattr(mine, name), getattr(theirs, name)
        if a == b or (model_differs and name in _IMPLIED_BY_MODEL):
            continue
        hint = fix.format(a=mine_role, b=theirs_role)
        errors.append(f"{what}: {mine_role} {a}, {theirs_role} {b}; {hint}")
    return " | ".join(errors) or None
