"""The index entry of one cached embedding, and the codec of its tensor payload. Pure: no I/O.

An embedding is one or more named tensors (Qwen3-VL's deepstack features travel with the image
embeddings), packed into one payload blob: each tensor's raw bytes (C order) at an offset aligned to
``ALIGN`` bytes, zero padding between. The ``Entry`` describes the blob: one ``TensorSpec`` per
tensor, plus what a prefill needs to know without reading the payload (token count, image grid),
who made it and when, and where the payload lives (``location``).

``unpack`` trusts nothing: any disagreement between the entry and the blob raises ``CorruptEntry``,
which the store turns into a miss (and deletes the entry). A mismatched embedding is never spliced
into a prompt. Only raw bytes and msgpack cross Redis; nothing is pickled.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from cache.errors import CorruptEntry

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1  # an entry of another version is a miss (written by another release)
ALIGN = 64
# the dtypes the cache stores, by name, with their item sizes; torch is imported only to pack or
# unpack tensors, so that readers of the index alone (the router) do not load it
DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


class TensorSpec(msgspec.Struct, frozen=True):
    """One tensor in the payload: ``nbytes`` raw bytes at ``offset``, of ``dtype`` and ``shape``."""

    name: str
    shape: list[int]
    dtype: str
    offset: int
    nbytes: int


class InRedis(msgspec.Struct, frozen=True, tag="redis"):
    """The payload is the ``payload`` field of the entry's own Redis hash (one key: meta + payload).

    A second location (tag ``"transfer"``: the encoder's registered memory, read over the transfer
    engine, with the encoder's address, buffer offset and a lease) joins as ``InRedis | InEncoder``.
    """


class Entry(msgspec.Struct, frozen=True):
    """Metadata of one cached embedding. ``last_used_at`` is filled in by the store on each read
    (from the LRU index); as written it equals ``created_at``. Times are Redis server seconds."""

    key: str
    tensors: list[TensorSpec]
    num_tokens: int
    image_grid: list[int]
    payload_bytes: int
    encoder: str
    created_at: float
    last_used_at: float
    location: InRedis
    version: int = FORMAT_VERSION

    def spec(self, name: str) -> TensorSpec:
        """The spec of tensor ``name``; KeyError if the entry has none."""
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise KeyError(name)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Entry)


def encode_entry(entry: Entry) -> bytes:
    return _encoder.encode(entry)


def decode_entry(data: bytes) -> Entry:
    """Decode stored metadata; ``CorruptEntry`` if it is not an ``Entry`` of this format version."""
    try:
        entry = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptEntry(f"entry metadata does not decode: {exc}") from None
    if entry.version != FORMAT_VERSION:
        raise CorruptEntry(f"entry format version {entry.version}, this release reads {FORMAT_VERSION}")
    return entry


def pack(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorSpec], bytes]:
    """Lay ``tensors`` out in one blob (insertion order). Tensors may live on any device; their bytes
    are copied to the host. ValueError for an empty dict, an empty name, or a dtype not in ``DTYPES``."""
    import torch

    if not tensors:
        raise ValueError("an embedding needs at least one tensor")
    specs: list[TensorSpec] = []
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        if not name:
            raise ValueError("tensor names must be non-empty")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; the cache stores {sorted(DTYPES)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        padding = -offset % ALIGN
        chunks.append(bytes(padding))
        offset += padding
        specs.append(TensorSpec(name, list(tensor.shape), dtype, offset, len(data)))
        chunks.append(data)
        offset += len(data)
    return specs, b"".join(chunks)


def unpack(entry: Entry, payload: bytes) -> dict[str, torch.Tensor]:
    """The tensors of ``entry`` read from ``payload``, on the host, in the entry's order.

    The tensors share one private copy of the payload (freed with the last of them). Raises
    ``CorruptEntry`` if the payload size, any dtype, shape, size or offset disagrees with the entry.
    """
    if len(payload) != entry.payload_bytes:
        raise CorruptEntry(f"payload of {entry.key} has {len(payload)} bytes, its entry says {entry.payload_bytes}")
    if not entry.tensors or len({s.name for s in entry.tensors}) != len(entry.tensors):
        raise CorruptEntry(f"entry {entry.key} lists no tensors or repeats a name")
    end = 0
    for spec in entry.tensors:
        _check_spec(entry.key, spec, end, len(payload))
        end = spec.offset + spec.nbytes
    import torch

    buffer = bytearray(payload)
    out: dict[str, torch.Tensor] = {}
    for spec in entry.tensors:
        raw = torch.frombuffer(buffer, dtype=torch.uint8, offset=spec.offset, count=spec.nbytes) if spec.nbytes \
            else torch.empty(0, dtype=torch.uint8)
        out[spec.name] = raw.view(_torch_dtype(spec.dtype)).reshape(spec.shape)
    return out


def _check_spec(key: str, spec: TensorSpec, start: int, size: int) -> None:
    """``spec`` must be a known dtype, a valid shape, sized to match, aligned, after ``start``, inside."""
    where = f"tensor {spec.name!r} of {key}"
    if spec.dtype not in DTYPES:
        raise CorruptEntry(f"{where} has dtype {spec.dtype!r}, not one of {sorted(DTYPES)}")
    if any(dim < 0 for dim in spec.shape):
        raise CorruptEntry(f"{where} has a negative dimension: {spec.shape}")
    expected = math.prod(spec.shape) * DTYPES[spec.dtype]
    if spec.nbytes != expected:
        raise CorruptEntry(f"{where}: shape {spec.shape} of {spec.dtype} is {expected} bytes, entry says {spec.nbytes}")
    if spec.offset % ALIGN or spec.offset < start or spec.offset + spec.nbytes > size:
        raise CorruptEntry(f"{where}: bytes {spec.offset}..{spec.offset + spec.nbytes} are not an aligned range "
                           f"after {start} inside the {size}-byte payload")
