"""The entry codec and config validation (pure, no Redis): round trips and every mismatch a CorruptEntry."""

from __future__ import annotations

import msgspec
import pytest
import torch

from cache.config import MIB, CacheConfig
from cache.entry import ALIGN, Entry, InRedis, TensorSpec, decode_entry, encode_entry, pack, unpack
from cache.errors import CorruptEntry

pytestmark = pytest.mark.unit

KEY = "ab" * 32


def make_entry(tensors: dict[str, torch.Tensor]) -> tuple[Entry, bytes]:
    specs, payload = pack(tensors)
    entry = Entry(KEY, specs, 6, [1, 4, 6], len(payload), "encoder-0", 1.5, 1.5, InRedis())
    return decode_entry(encode_entry(entry)), payload


def deepstack() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"embeddings": torch.randn(6, 32).to(torch.bfloat16),
            "deepstack": torch.randn(3, 6, 32).to(torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    tensor = torch.randn(5, 7).to(dtype)
    entry, payload = make_entry({"embeddings": tensor})
    out = unpack(entry, payload)
    assert list(out) == ["embeddings"]
    assert out["embeddings"].dtype == dtype and torch.equal(out["embeddings"], tensor)


def test_two_tensor_payload_keeps_order_alignment_and_metadata() -> None:
    tensors = deepstack()
    entry, payload = make_entry(tensors)
    assert [s.name for s in entry.tensors] == ["embeddings", "deepstack"]
    assert entry.spec("deepstack") == TensorSpec("deepstack", [3, 6, 32], "bfloat16", 384, 1152)
    assert all(s.offset % ALIGN == 0 for s in entry.tensors)
    assert len(payload) == entry.payload_bytes == 384 + 1152
    out = unpack(entry, payload)
    assert all(torch.equal(out[n], tensors[n]) for n in tensors)
    assert (entry.num_tokens, entry.image_grid, entry.encoder, entry.location) == (6, [1, 4, 6], "encoder-0", InRedis())


def test_unpacked_tensors_do_not_alias_the_payload_or_the_input() -> None:
    tensors = {"e": torch.ones(4)}
    entry, payload = make_entry(tensors)
    out = unpack(entry, payload)
    out["e"] += 1
    assert torch.equal(tensors["e"], torch.ones(4)) and torch.equal(unpack(entry, payload)["e"], torch.ones(4))


def test_empty_and_scalar_tensors() -> None:
    tensors = {"none": torch.zeros(0, 8), "scalar": torch.tensor(3.5)}
    entry, payload = make_entry(tensors)
    out = unpack(entry, payload)
    assert out["none"].shape == (0, 8) and out["scalar"].shape == () and out["scalar"].item() == 3.5


@pytest.mark.parametrize(("tensors", "message"), [
    ({}, "an embedding needs at least one tensor"),
    ({"": torch.zeros(1)}, "tensor names must be non-empty"),
    ({"e": torch.zeros(1, dtype=torch.float64)},
     "tensor 'e' has dtype torch.float64; the cache stores ['bfloat16', 'float16', 'float32']"),
])
def test_pack_rejects_what_it_cannot_store(tensors: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        pack(tensors)
    assert str(info.value) == message


def replace_spec(entry: Entry, index: int, **changes) -> Entry:
    specs = list(entry.tensors)
    specs[index] = msgspec.structs.replace(specs[index], **changes)
    return msgspec.structs.replace(entry, tensors=specs)


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda e, p: (e, p[:-1]), f"payload of {KEY} has 1535 bytes, its entry says 1536"),
    (lambda e, p: (replace_spec(e, 0, shape=[6, 33]), p),
     f"tensor 'embeddings' of {KEY}: shape [6, 33] of bfloat16 is 396 bytes, entry says 384"),
    (lambda e, p: (replace_spec(e, 0, dtype="float32"), p),
     f"tensor 'embeddings' of {KEY}: shape [6, 32] of float32 is 768 bytes, entry says 384"),
    (lambda e, p: (replace_spec(e, 0, dtype="int8"), p),
     f"tensor 'embeddings' of {KEY} has dtype 'int8', not one of ['bfloat16', 'float16', 'float32']"),
    (lambda e, p: (replace_spec(e, 1, offset=320), p),
     f"tensor 'deepstack' of {KEY}: bytes 320..1472 are not an aligned range after 384 inside the 1536-byte payload"),
    (lambda e, p: (replace_spec(e, 1, offset=400), p),
     f"tensor 'deepstack' of {KEY}: bytes 400..1552 are not an aligned range after 384 inside the 1536-byte payload"),
    (lambda e, p: (replace_spec(e, 1, shape=[-3, 6, -32]), p),
     f"tensor 'deepstack' of {KEY} has a negative dimension: [-3, 6, -32]"),
    (lambda e, p: (replace_spec(e, 1, name="embeddings"), p), f"entry {KEY} lists no tensors or repeats a name"),
    (lambda e, p: (msgspec.structs.replace(e, tensors=[]), p), f"entry {KEY} lists no tensors or repeats a name"),
])
def test_any_disagreement_between_entry_and_payload_is_corrupt(corrupt, message) -> None:
    entry, payload = corrupt(*make_entry(deepstack()))
    with pytest.raises(CorruptEntry) as info:
        unpack(entry, payload)
    assert str(info.value) == message


def test_tensors_always_have_the_shape_the_entry_states() -> None:
    # A same-size reshape cannot be told from the bytes: the tensor takes the entry's shape, which
    # the consumer checks against the token count it expects from the image size.
    entry, payload = make_entry(deepstack())
    assert unpack(replace_spec(entry, 0, shape=[12, 16]), payload)["embeddings"].shape == (12, 16)


def test_metadata_that_does_not_decode_or_has_another_version_is_corrupt() -> None:
    with pytest.raises(CorruptEntry, match="entry metadata does not decode"):
        decode_entry(b"\x93garbage")
    entry, _ = make_entry({"e": torch.zeros(2)})
    with pytest.raises(CorruptEntry, match="entry format version 2, this release reads 1"):
        decode_entry(encode_entry(msgspec.structs.replace(entry, version=2)))
    with pytest.raises(CorruptEntry, match="does not decode"):
        decode_entry(msgspec.msgpack.encode({**msgspec.to_builtins(entry), "location": {"type": "transfer"}}))


@pytest.mark.parametrize(("changes", "message"), [
    ({"url": "http://127.0.0.1:6379"}, "--redis-url must start with redis://, rediss:// or unix://"),
    ({"budget_bytes": 0}, "--cache-budget-mib must be positive, got 0 MiB"),
    ({"ttl_s": 0}, "--cache-ttl-s must be positive, got 0"),
    ({"op_timeout_s": -1}, "--cache-op-timeout-s must be positive, got -1"),
    ({"max_connections": 1}, "max_connections must be at least 2"),
    ({"claim_check_s": 0}, "--claim-check-s must be positive, got 0"),
])
def test_config_rejects_bad_values_naming_the_flag(changes: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        CacheConfig(**{"url": "redis://127.0.0.1:6379/0", "budget_bytes": MIB, "ttl_s": 60, **changes})
    assert str(info.value).startswith(message)


def test_config_never_shows_the_password() -> None:
    config = CacheConfig(url="redis://user:s3cret@10.0.0.5:6379/0", budget_bytes=MIB, ttl_s=1)
    assert config.safe_url == "redis://user:***@10.0.0.5:6379/0"
    with pytest.raises(ValueError) as info:
        CacheConfig(url="http://user:s3cret@host", budget_bytes=MIB, ttl_s=1)
    assert "s3cret" not in str(info.value)
