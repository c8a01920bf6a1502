"""A checkpoint's weight files checked without torch: every file the loader will open is there and whole.

The safetensors format is an 8-byte little-endian header length N, N bytes of JSON (each tensor's
``data_offsets`` [begin, end) into the data that follows, plus an optional ``__metadata__``), then
the data. A whole file is exactly ``8 + N + max(end)`` bytes long; a copy or download cut short is
shorter. Reading the header costs a few kilobytes per file, whatever the size of the weights.

Which files the loader opens (transformers' order): ``model.safetensors``; else the shards named in
``model.safetensors.index.json``; else ``pytorch_model.bin``; else the shards of
``pytorch_model.bin.index.json`` (checked for presence only: pickles are not read here).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own bound on a header


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` is not whole, in words naming it (``"model.safetensors is
    truncated (...)"``), or None. Reads the header only."""
    name, size = path.name, path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{name} is truncated ({size} bytes, shorter than a safetensors header)"
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            return f"{name} is not a safetensors file (a header of {n} bytes)"
        if 8 + n > size:
            return f"{name} is truncated ({size} bytes, its header alone takes {8 + n})"
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            return f"{name} is not a safetensors file (its header does not parse: {exc})"
    expected = 8 + n + end
    if size < expected:
        return f"{name} is truncated ({size} of {expected} bytes)"
    if size > expected:
        return f"{name} is not a safetensors file ({size - expected} bytes after its last tensor)"
    return None


def index_files(index: Path) -> list[str] | str:
    """The distinct file names an index's ``weight_map`` names, in order, or why it cannot be read."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return list(dict.fromkeys(str(name) for name in weight_map.values()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"{index.name} does not parse as an index ({type(exc).__name__}: {exc})"


def weights_problem(path: Path) -> str | None:
    """Why the weights in checkpoint directory ``path`` cannot be loaded, naming the file, or None.
    Follows the loader's order (``model.safetensors``, its index, ``pytorch_model.bin``, its index):
    the first present is what loads; every file it opens must exist, and each safetensors one be whole."""
    if (path / "model.safetensors").is_file():
        return safetensors_problem(path / "model.safetensors")
    if (path / SAFETENSORS_INDEX).is_file():
        return _shards_problem(path, path / SAFETENSORS_INDEX, safetensors=True)
    if (path / "pytorch_model.bin").is_file():
        return None
    if (path / BIN_INDEX).is_file():
        return _shards_problem(path, path / BIN_INDEX, safetensors=False)
    if shards := sorted(p.name for p in path.glob("*.safetensors")):
        return f"{SAFETENSORS_INDEX} is missing (it names the shards: {', '.join(shards)})"
    return "no weights in it (*.safetensors, pytorch_model*.bin)"


def _shards_problem(path: Path, index: Path, safetensors: bool) -> str | None:
    names = index_files(index)
    if isinstance(names, str):
        return names
    if not names:
        return f"{index.name} names no weight files"
    for name in names:
        if not (path / name).is_file():
            return f"{name} is missing (named in {index.name})"
        if safetensors and (problem := safetensors_problem(path / name)) is not None:
            return problem
    return None
