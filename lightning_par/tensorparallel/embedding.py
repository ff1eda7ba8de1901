"""An embedding split by vocabulary, and dropout on split activations.

:class:`VocabParallelEmbedding` (Megatron-LM's ``VocabParallelEmbedding``): rank ``k`` holds
rows ``[start_k, start_k + sizes[k])`` of the table; every rank looks up the tokens in its
range, writes zeros for the others, and ``g`` sums the ranks' outputs (exact: one real row
plus zeros).

:class:`ShardedDropout`: dropout between a column and a row layer acts on a split
activation. Megatron draws each shard's mask from a per-rank random stream (its RNG
tracker), which is fast but gives other masks than one process. Here every rank draws the
mask of the *whole* activation from the same stream, exactly as one process's dropout
would, and keeps its slice: the ranks' random generators stay in step with one process's,
and the result equals one process with the same seed (the price: each rank draws the full
mask, ``p`` times the random numbers of its own slice).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.split import offsets
from lightning_par.tensorparallel.layers import _Parallel
from lightning_par.tensorparallel.mappings import TPGroup, local_slice, reduce_from
from lightning_par.tensorparallel.shard import Shard


def embedding_reason(embedding: nn.Embedding, p: int) -> str:
    """Why ``embedding`` cannot be split exactly over ``p`` ranks ("" when it can)."""
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return "max_norm, scale_grad_by_freq or sparse gradients"
    if embedding.num_embeddings < p:
        return f"{embedding.num_embeddings} rows cannot be split over {p} ranks"
    return ""


class VocabParallelEmbedding(_Parallel):
    """``nn.Embedding`` with its rows (the vocabulary) split over the ranks."""

    def __init__(self, embedding: nn.Embedding, group: TPGroup, sizes: Sequence[int]) -> None:
        why = embedding_reason(embedding, len(sizes))
        if why:
            raise ValueError(f"tensor_parallel cannot split this embedding: {why}")
        super().__init__(group, sizes)
        self.start = offsets(self.sizes)[group.rank]
        pad = embedding.padding_idx
        local = None if pad is None else pad - self.start
        self.padding_idx = (
            local if local is not None and 0 <= local < self.sizes[group.rank] else None
        )
        self._take("weight", embedding.weight, Shard(0, self.sizes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        elsewhere = (local < 0) | (local >= self.sizes[self.group.rank])
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight, self.padding_idx)
        return reduce_from(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


class ShardedDropout(nn.Module):
    """``nn.Dropout`` on an activation split along ``dim`` (``sizes`` per rank), drawing the
    whole activation's mask as one process would and keeping this rank's slice."""

    def __init__(self, dropout: nn.Dropout, group: TPGroup, sizes: Sequence[int], dim: int):
        super().__init__()
        self.p, self.inplace = dropout.p, dropout.inplace
        self.group, self.sizes, self.dim = group, tuple(sizes), dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        shape = list(x.shape)
        shape[self.dim] = sum(self.sizes)
        mask = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), self.p, True)
        return x * local_slice(mask, self.sizes, self.dim, self.group.rank)

    def extra_repr(self) -> str:
        return f"p={self.p}, rank={self.group.rank}, sizes={list(self.sizes)}, dim={self.dim}"
