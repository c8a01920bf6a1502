"""Block hashes for prefix caching. Pure: hashlib only, no torch, no I/O.

A full block's hash is a chain: sha256 over the parent block's hash, the block's token ids and the
content keys (``cache.keys``) of every image whose placeholder tokens fall in the block, even in part.
Equal hashes mean the whole prefix up to the block's end is the same tokens with the same images, so
its KV is the same (positions, M-RoPE included, follow from the tokens and the images before them).
Two different images of one size expand to the same placeholder ids but have different keys, so
they never share a block.

A prompt whose images have no content keys (``Prompt.image_keys`` None) is hashed only up to the
first block holding an image token: no block with an image in it is ever shared without its key.
Only full blocks have hashes; a prompt's last partial block is never cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence

ROOT = b""  # the parent of a prompt's first block


def covered_items(token_ids: Sequence[int], media_token_ids: Collection[int], image_tokens: Sequence[int],
                  cached_tokens: int) -> frozenset[int]:
    """Indexes of the items (images, videos) whose placeholders lie wholly in the prompt's first
    ``cached_tokens``: a prefix hit holds their KV, so nothing of them is needed. ValueError as
    ``image_spans``."""
    if cached_tokens <= 0:
        return frozenset()
    spans = image_spans(token_ids, media_token_ids, image_tokens)
    return frozenset(i for i, (_, end) in enumerate(spans) if end <= cached_tokens)


def image_spans(token_ids: Sequence[int], media_token_ids: Collection[int],
                image_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` prompt positions of each image's (or video's) placeholders, the tokens in
    ``media_token_ids``: item i fills the next ``image_tokens[i]`` of them (a Qwen3-VL video's span also
    covers the timestamps between its frames). ValueError if the counts disagree."""
    positions = [i for i, token in enumerate(token_ids) if token in media_token_ids]
    if len(positions) != sum(image_tokens):
        raise ValueError(f"prompt has {len(positions)} image placeholder tokens but its images fill {sum(image_tokens)}")
    spans, offset = [], 0
    for count in image_tokens:
        if count <= 0:
            raise ValueError(f"an image fills {count} placeholder tokens")
        spans.append((positions[offset], positions[offset + count - 1] + 1))
        offset += count
    return spans


def hash_block(parent: bytes, token_ids: Sequence[int], image_keys: Sequence[str]) -> bytes:
    """One link of the chain: the block's tokens and the keys of the images in it, after its parent's hash."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    for key in image_keys:
        digest.update(b"i" + key.encode())
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, media_token_ids: Collection[int], image_tokens: Sequence[int],
                 image_keys: Sequence[str] | None) -> list[bytes]:
    """The chain hashes of the full blocks of ``token_ids``, block 0 first (see the module docstring).
    ``image_keys``: one content key per image, or None (then the chain stops at the first image)."""
    if image_keys is not None and len(image_keys) != len(image_tokens):
        raise ValueError(f"prompt has {len(image_tokens)} images but {len(image_keys)} image keys")
    spans = image_spans(token_ids, media_token_ids, image_tokens)
    hashes: list[bytes] = []
    parent = ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        inside = [i for i, (first, last) in enumerate(spans) if first < end and last > start]
        if inside and image_keys is None:
            break
        parent = hash_block(parent, token_ids[start:end], [image_keys[i] for i in inside] if image_keys else [])
        hashes.append(parent)
    return hashes
