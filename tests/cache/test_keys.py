"""Content keys and vision fingerprints (pure, no Redis)."""

from __future__ import annotations

import blake3
import pytest
import torch

from cache.keys import check_key, image_key, vision_fingerprint, weights_digest

pytestmark = pytest.mark.unit

VISION = {"depth": 2, "embed_dim": 64, "patch_size": 14, "_name_or_path": "/models/a",
          "transformers_version": "5.24.0", "spatial_merge_size": 2}
PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "image_mean": [0.5, 0.5, 0.5], "patch_size": 14}


def fingerprint(vision=VISION, processor=PROCESSOR, dtype="float32", weights="w1") -> str:
    return vision_fingerprint(vision, processor, dtype=dtype, weights=weights)


def test_fingerprint_is_stable_and_ignores_key_order_and_save_location() -> None:
    reordered = dict(reversed(list(VISION.items())))
    moved = {**VISION, "_name_or_path": "/elsewhere", "transformers_version": "5.99.0", "_commit_hash": "abc"}
    assert fingerprint() == fingerprint(vision=reordered) == fingerprint(vision=moved)
    assert len(fingerprint()) == 64 and check_key(fingerprint())


@pytest.mark.parametrize("change", [
    {"vision": {**VISION, "depth": 3}},
    {"processor": {**PROCESSOR, "max_pixels": 1003520}},
    {"processor": {**PROCESSOR, "image_mean": [0.5, 0.5, 0.4]}},
    {"dtype": "bfloat16"},
    {"weights": "w2"},
])
def test_fingerprint_changes_with_anything_that_changes_the_embedding(change: dict) -> None:
    assert fingerprint(**change) != fingerprint()


def test_image_key_is_keyed_blake3_of_the_bytes() -> None:
    fp_a, fp_b = fingerprint(), fingerprint(weights="w2")
    key = image_key(b"\x89PNG image bytes", fp_a)
    assert key == blake3.blake3(b"\x89PNG image bytes", key=bytes.fromhex(fp_a)).hexdigest()
    assert key == image_key(b"\x89PNG image bytes", fp_a)
    assert key != image_key(b"\x89PNG image bytez", fp_a)
    assert key != image_key(b"\x89PNG image bytes", fp_b)  # two models never share an entry
    assert check_key(key) == key


def test_image_key_rejects_a_fingerprint_that_is_not_one() -> None:
    with pytest.raises(ValueError, match="not an image cache key"):
        image_key(b"x", "qwen2_vl-0123")


@pytest.mark.parametrize("bad", ["", "A" * 64, "g" * 64, "a" * 63, "a" * 65, "epd:*", None])
def test_check_key_rejects_anything_but_64_lowercase_hex(bad) -> None:
    with pytest.raises(ValueError, match=r"not an image cache key \(want 64 lowercase hex digits\)"):
        check_key(bad)


def test_weights_digest_covers_names_values_dtypes_and_not_order() -> None:
    torch.manual_seed(0)
    weights = {"proj.weight": torch.randn(4, 3), "proj.bias": torch.randn(4).to(torch.bfloat16)}
    digest = weights_digest(weights.items())
    assert digest == weights_digest(reversed(list(weights.items())))
    changed = {**weights, "proj.bias": weights["proj.bias"].clone()}
    changed["proj.bias"][0] += 1
    assert weights_digest(changed.items()) != digest
    assert weights_digest({"proj.w": weights["proj.weight"], "proj.bias": weights["proj.bias"]}.items()) != digest
    assert weights_digest({**weights, "proj.weight": weights["proj.weight"].half()}.items()) != digest
