"""A cached embedding checked against its image reference (stages/disagg/embeddings.py's
check_embedding): an entry that fits becomes the embedding; one that does not (tokens, grid,
shape, tensors, dtype) is refused with the reason. Pure."""

from __future__ import annotations

import pytest
import torch

from cache.entry import Entry, InRedis
from cache.store import CachedEmbedding
from stages.disagg.embeddings import EmbeddingShape, Expected, Mismatch, check_embedding

pytestmark = pytest.mark.unit

KEY = "ab" * 32


def hit(num_tokens: int = 4, grid: list[int] | None = None, **tensors: torch.Tensor) -> CachedEmbedding:
    tensors = tensors or {"embeds": torch.ones(num_tokens, 8)}
    entry = Entry(KEY, [], num_tokens, [1, 4, 4] if grid is None else grid, 0, "enc", 0.0, 0.0, InRedis())
    return CachedEmbedding(entry, tensors)


QWEN = EmbeddingShape(hidden_size=8, deepstack_layers=0)
EXPECTED = Expected(num_tokens=4, grid=(1, 4, 4))


def test_an_entry_that_fits_becomes_the_embedding():
    embedding = check_embedding(hit(), EXPECTED, QWEN)
    assert embedding.num_tokens == 4 and embedding.grid_thw == (1, 4, 4) and embedding.deepstack is None
    deep = check_embedding(hit(embeds=torch.ones(4, 8), deepstack=torch.ones(2, 4, 8)), EXPECTED,
                           EmbeddingShape(8, 2))
    assert deep.deepstack.shape == (2, 4, 8)
    assert check_embedding(hit(grid=[]), Expected(4, None), QWEN).grid_thw is None  # LLaVA: no grid


@pytest.mark.parametrize("cached, expected, shape, reason", [
    (hit(num_tokens=5, embeds=torch.ones(5, 8)), EXPECTED, QWEN, "the entry has 5 tokens, the reference's size fills 4"),
    (hit(grid=[1, 2, 8]), EXPECTED, QWEN, "the entry's image grid is [1, 2, 8], the reference's size gives [1, 4, 4]"),
    (hit(embeds=torch.ones(4, 16)), EXPECTED, QWEN, "tensor 'embeds' has shape [4, 16], this model needs [4, 8]"),
    (hit(embeds=torch.ones(3, 8)), EXPECTED, QWEN, "tensor 'embeds' has shape [3, 8], this model needs [4, 8]"),
    (hit(), EXPECTED, EmbeddingShape(8, 2), "the entry holds tensors ['embeds'], this model needs ['deepstack', 'embeds']"),
    (hit(embeds=torch.ones(4, 8), deepstack=torch.ones(2, 4, 8)), EXPECTED, QWEN,
     "the entry holds tensors ['deepstack', 'embeds'], this model needs ['embeds']"),
    (hit(embeds=torch.ones(4, 8), deepstack=torch.ones(3, 4, 8)), EXPECTED, EmbeddingShape(8, 2),
     "tensor 'deepstack' has shape [3, 4, 8], this model needs [2, 4, 8]"),
    (hit(embeds=torch.ones(4, 8, dtype=torch.int32)), EXPECTED, QWEN,
     "tensor 'embeds' has dtype torch.int32, not a floating-point type"),
], ids=["tokens", "grid", "hidden", "rows", "no-deepstack", "extra-deepstack", "deepstack-layers", "dtype"])
def test_an_entry_that_does_not_fit_is_refused_by_name(cached, expected, shape, reason):
    with pytest.raises(Mismatch) as refused:
        check_embedding(cached, expected, shape)
    assert str(refused.value) == reason
