"""Prefix caching's pure parts: block hashes, the refcounted allocator's index, and the scheduler's
admission (longest cached chain, capped below the last prompt token) and registration. No torch."""

import msgspec
import pytest

from stages.engine.block_allocator import BlockAllocator
from stages.engine.multimodal import Prompt
from stages.engine.prefix_cache import ROOT, block_hashes, hash_block, image_spans
from stages.engine.request import FinishReason, Request
from stages.engine.sampling_params import SamplingParams
from stages.engine.scheduler import Scheduler
from transfer.fingerprint import Fingerprint
from transfer.messages import KVRequest, check_kv_request

pytestmark = pytest.mark.unit

IMG = 99  # the image placeholder id of these prompts
KEY_A, KEY_B = "a" * 64, "b" * 64


def test_image_spans_follow_each_images_count():
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    assert image_spans(ids, {IMG}, [2, 3]) == [(1, 3), (4, 7)]
    assert image_spans([IMG] * 5, {IMG}, [2, 3]) == [(0, 2), (2, 5)]  # adjacent images split by count
    with pytest.raises(ValueError, match="4 image placeholder tokens but its images fill 5"):
        image_spans([IMG] * 4, {IMG}, [2, 3])


def test_hashes_chain_full_blocks_only():
    ids = list(range(10))
    hashes = block_hashes(ids, 4, {IMG}, [], None)
    assert len(hashes) == 2  # 10 tokens: two full blocks, the partial third is never hashed
    assert hashes[0] == hash_block(ROOT, [0, 1, 2, 3], [])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7], [])
    # a block equal in tokens but after another parent hashes differently
    assert block_hashes([9, 9, 9, 9] + [4, 5, 6, 7], 4, {IMG}, [], None)[1] != hashes[1]
    assert block_hashes(ids[:8], 4, {IMG}, [], None) == hashes  # a prefix's chain is a prefix of the chain


def test_two_images_of_one_size_never_share_a_block():
    ids = [1, 2, 3, IMG, IMG, IMG, IMG, IMG, 4, 5, 6, 7]  # the image covers parts of blocks 0 and 1 (size 4)
    a = block_hashes(ids, 4, {IMG}, [5], [KEY_A])
    b = block_hashes(ids, 4, {IMG}, [5], [KEY_B])
    assert len(a) == len(b) == 3 and all(x != y for x, y in zip(a, b))
    assert a == block_hashes(ids, 4, {IMG}, [5], [KEY_A])  # the same image: the same chain
    text_only = [1, 2, 3, 8, 9, 9, 9, 9]
    assert block_hashes(text_only, 4, {IMG}, [], [])[0] != a[0]


def test_without_image_keys_the_chain_stops_at_the_first_image():
    ids = [1, 2, 3, 4, 5, IMG, IMG, 6, 7, 8, 9, 10]
    assert block_hashes(ids, 4, {IMG}, [2], None) == block_hashes(ids, 4, {IMG}, [2], [KEY_A])[:1]
    with pytest.raises(ValueError, match="1 images but 2 image keys"):
        block_hashes(ids, 4, {IMG}, [2], [KEY_A, KEY_B])


# --- the allocator --------------------------------------------------------------------------------
def test_freed_cached_blocks_stay_cached_until_the_pool_needs_them():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    blocks = allocator.allocate(2)
    assert allocator.register(blocks[0], b"h0") and allocator.register(blocks[1], b"h1")
    allocator.free(blocks)
    assert (allocator.num_used, allocator.num_cached, allocator.num_free) == (0, 2, 4)
    assert allocator.cached_prefix([b"h0", b"h1", b"h2"]) == blocks
    assert allocator.allocate(2) == [2, 3]  # never-cached blocks go first
    assert allocator.cached_prefix([b"h0", b"h1"]) == blocks
    evicted = allocator.allocate(1)  # then the least recently freed cached block, unregistered
    assert evicted == [blocks[0]] and allocator.cached_prefix([b"h0", b"h1"]) == []
    assert allocator.cached_prefix([b"h1"]) == [blocks[1]] and allocator.num_cached == 1
    with pytest.raises(MemoryError, match="asked for 2 KV blocks, 1 free of 4"):
        allocator.allocate(2)


def test_shared_blocks_are_refcounted():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    (block,) = allocator.allocate(1)
    allocator.register(block, b"h")
    assert allocator.share([block]) == [block]  # a second holder while the first still runs
    allocator.free([block])
    assert (allocator.num_used, allocator.num_cached) == (1, 0)  # still held by the other
    allocator.free([block])
    assert (allocator.num_used, allocator.num_cached) == (0, 1)
    with pytest.raises(ValueError, match="not in use"):
        allocator.free([block])  # a third free: nobody holds it
    assert allocator.can_allocate(4) and not allocator.can_allocate(4, shared=[block])
    allocator.share([block])  # from the evictable set back to in use
    assert (allocator.num_used, allocator.num_cached, allocator.num_free) == (1, 0, 3)
    allocator.free([block])


def test_register_keeps_the_first_copy_and_refuses_strangers():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    first, second = allocator.allocate(2)
    assert allocator.register(first, b"h")
    assert not allocator.register(second, b"h")  # the same block computed twice: one copy cached
    assert not allocator.register(first, b"other")
    allocator.free([first, second])
    assert (allocator.num_cached, allocator.num_free) == (1, 4)
    with pytest.raises(ValueError, match="not in use"):
        allocator.register(second, b"x")
    with pytest.raises(ValueError, match="not cached"):
        allocator.share([second])
    assert allocator.num_used == 0


# --- the scheduler --------------------------------------------------------------------------------
def make_request(name: str, ids: list[int], max_tokens: int = 2, hashed: bool = True) -> Request:
    return Request(name, Prompt(token_ids=ids), SamplingParams(max_tokens=max_tokens),
                   block_hashes=block_hashes(ids, 4, {IMG}, [], None) if hashed else None)


def run_to_end(scheduler: Scheduler, bound: int = 20) -> None:
    """Pretend steps run as the runner does; every request finishes when its prompt is done."""
    for _ in range(bound):
        if not scheduler.has_work():
            return
        batch = scheduler.schedule()
        for request in batch.prefills:
            request.num_computed = request.chunk_end
            if request.prompt_done:
                request.finish(FinishReason.LENGTH)
        scheduler.after_step(batch)
    raise AssertionError("the scheduler did not finish within the bound")


def test_admission_starts_past_the_longest_cached_chain():
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_batched_tokens=64)
    scheduler.add(make_request("first", list(range(10))))
    run_to_end(scheduler)
    assert (scheduler.allocator.num_used, scheduler.allocator.num_cached) == (0, 2)  # blocks 0-3, 4-7
    longer = make_request("longer", list(range(14)))
    scheduler.add(longer)
    batch = scheduler.schedule()
    assert longer.num_computed == longer.num_cached_tokens == 8 and batch.chunks == [6]
    assert scheduler.allocator.num_cached == 0 and (scheduler.prefix_queries, scheduler.prefix_hit_tokens) == (24, 8)


def test_hit_leaves_the_last_prompt_token_to_compute():
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_batched_tokens=64)
    scheduler.add(make_request("first", list(range(8))))
    run_to_end(scheduler)
    again = make_request("again", list(range(8)))  # both blocks cached; the second holds the last token
    scheduler.add(again)
    batch = scheduler.schedule()
    assert again.num_computed == 4 and batch.chunks == [4]
    assert again.blocks[0] != again.blocks[1]  # block 1 is computed again into a block of its own


def test_blocks_register_chunk_by_chunk_and_are_shared_while_running():
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_batched_tokens=6)
    long = make_request("long", list(range(13)), max_tokens=4)
    scheduler.add(long)
    batch = scheduler.schedule()
    long.num_computed = long.chunk_end  # 6 tokens: block 0 complete
    scheduler.after_step(batch)
    assert long.num_registered == 1
    follower = make_request("follower", list(range(5)))
    scheduler.add(follower)
    batch = scheduler.schedule()
    assert batch.prefills == [long]  # its next chunk takes the whole budget: the follower waits
    long.num_computed = long.chunk_end
    scheduler.after_step(batch)
    batch = scheduler.schedule()  # long's last token + the follower's, past its hit
    assert batch.prefills == [long, follower] and batch.chunks == [1, 1]
    assert follower.blocks[0] == long.blocks[0] and follower.num_computed == 4 and not long.prompt_done
    assert scheduler.allocator.num_used == len(long.blocks) + len(follower.blocks) - 1


def test_abort_releases_references_and_keeps_computed_blocks_cached():
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_batched_tokens=6)
    scheduler.add(make_request("aborted", list(range(13))))
    batch = scheduler.schedule()
    batch.prefills[0].num_computed = batch.prefills[0].chunk_end
    scheduler.after_step(batch)
    scheduler.abort("aborted")
    assert (scheduler.allocator.num_used, scheduler.allocator.num_cached) == (0, 1)
    scheduler.add(make_request("retry", list(range(13))))
    assert scheduler.schedule().prefills[0].num_computed == 4


def test_off_means_no_lookup_and_no_registration():
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_batched_tokens=64)
    for name in ("a", "b"):
        scheduler.add(make_request(name, list(range(10)), hashed=False))
        run_to_end(scheduler)
    assert scheduler.allocator.num_cached == 0 and (scheduler.prefix_queries, scheduler.prefix_hit_tokens) == (0, 0)


def test_a_hit_counts_only_the_blocks_it_does_not_share_against_the_pool():
    scheduler = Scheduler(BlockAllocator(4, 4), max_num_seqs=4, max_batched_tokens=64)
    scheduler.add(make_request("first", list(range(9)), max_tokens=1))  # 3 blocks, 2 registered
    run_to_end(scheduler)
    holder = scheduler.allocator.allocate(1)  # 3 free: 1 never cached + 2 cached
    # 9 + 4 - 1 = 12 slots = 3 blocks: two shared from the cache, one fresh
    request = make_request("second", list(range(9)), max_tokens=4)
    scheduler.add(request)
    assert scheduler.schedule().prefills == [request] and request.num_computed == 8
    assert scheduler.allocator.num_free == 0
    scheduler.allocator.free(holder)


def test_reserve_shares_the_cached_chain_for_a_prompt_written_from_elsewhere():
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_batched_tokens=64)
    first = make_request("first", list(range(10)))
    assert scheduler.reserve(first) == 0 and len(first.blocks) == 3  # the prompt's 10 slots (KV on demand)
    first.num_computed = first.prompt_len  # its KV arrived (a decode's add_prefilled)
    scheduler.register(first)
    assert first.num_registered == 2
    second = make_request("second", list(range(12)), max_tokens=4)
    assert scheduler.reserve(second) == 2 and second.blocks[:2] == first.blocks[:2]  # within 11 tokens
    assert second.num_cached_tokens == 8 and scheduler.allocator.num_used == 3 + 3 - 2
    with pytest.raises(MemoryError, match="asked for 5 KV blocks, 4 free of 8"):
        scheduler.reserve(make_request("third", list(range(20, 40)), max_tokens=1))
    assert scheduler.allocator.num_used == 4  # the refused reservation holds nothing
    scheduler.allocator.free(first.blocks)
    scheduler.allocator.free(second.blocks)
    assert (scheduler.allocator.num_used, scheduler.allocator.num_cached) == (0, 2)


def test_a_kv_request_may_name_the_decodes_cached_blocks_but_not_all_of_them():
    fingerprint = Fingerprint(model="m-0123456789abcdef", backend="mooncake", dtype="float32", block_size=16,
                              num_layers=2, num_kv_heads=2, head_dim=16, block_bytes=8192)

    def request(block_ids: list[int], cached: int, prompt_tokens: int = 40) -> KVRequest:
        return KVRequest(room=1, fingerprint=fingerprint, block_ids=block_ids, prompt_tokens=prompt_tokens,
                         descriptor=b"", decode_id="d", cached_blocks=cached)

    assert check_kv_request(request([7], cached=2), fingerprint) is None  # 2 cached + 1 written = 48 slots
    assert check_kv_request(request([7], cached=1), fingerprint) == \
        "decode reserved 1 blocks of 16 tokens (32 slots with 1 cached) for a 40-token prompt"
    refused = "cached_blocks must leave the prompt's last block to write: 3 of a 40-token prompt's blocks of 16 tokens"
    assert check_kv_request(request([7], cached=3), fingerprint) == refused
    assert (check_kv_request(request([7], cached=-1), fingerprint) or "").startswith("cached_blocks must leave")
    old = msgspec.json.decode(msgspec.json.encode(request([5, 6, 7], cached=0)))  # a peer without the field
    del old["cached_blocks"]
    assert msgspec.convert(old, KVRequest).cached_blocks == 0
