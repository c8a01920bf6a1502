"""The block allocator alone: no model, no torch."""

import pytest

from stages.engine.block_allocator import BlockAllocator, blocks_for_tokens

pytestmark = pytest.mark.unit


def test_blocks_for_tokens_rounds_up():
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        blocks_for_tokens(-1, 16)


def test_allocate_and_free_round_trip():
    allocator = BlockAllocator(num_blocks=8, block_size=16)
    first = allocator.allocate(3)
    second = allocator.allocate(5)
    assert first == [0, 1, 2] and second == [3, 4, 5, 6, 7]
    assert allocator.num_free == 0 and allocator.num_used == 8
    assert not allocator.can_allocate(1)
    allocator.free(first)
    assert allocator.num_free == 3
    assert allocator.allocate(3) == [0, 1, 2]  # freed runs come back contiguous and in order


def test_can_allocate_has_no_side_effects():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    for _ in range(3):
        assert allocator.can_allocate(4)
    assert allocator.num_free == 4


def test_over_allocation_raises_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    with pytest.raises(MemoryError, match="asked for 5 KV blocks, 4 free of 4"):
        allocator.allocate(5)
    assert allocator.num_free == 4


def test_double_free_and_foreign_ids_raise():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    blocks = allocator.allocate(2)
    allocator.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        allocator.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        allocator.free([99])
    held = allocator.allocate(1)
    with pytest.raises(ValueError):
        allocator.free(held + held)
    assert allocator.num_used == 1


@pytest.mark.parametrize("bad", [(0, 16), (4, 0), (-1, 16)])
def test_rejects_empty_pools(bad):
    with pytest.raises(ValueError):
        BlockAllocator(*bad)
