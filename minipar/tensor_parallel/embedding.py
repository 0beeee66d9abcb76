"""The vocabulary-parallel embedding (Shoeybi et al. 2019, Section 3, "input embedding").

The embedding matrix E (V, h) is split by rows, along the vocabulary: rank r holds the
rows of tokens ``[r·V/t, (r+1)·V/t)``. A lookup is a one-hot matrix multiply, so it is
row-parallel: each rank looks up the tokens it owns, writes zeros for the others, and g
(all-reduce) sums the partial results; exactly one rank contributed each token's row.
Under sequence parallelism the sum is a reduce-scatter along the sequence instead (ḡ),
leaving each rank the embeddings of its own s/t tokens. The output head ``h -> V`` is
column-parallel with the same split, so a tied head can share this very weight shard.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops import divide, g, size_and_rank
from .sequence import check_seq_len, reduce_scatter_seq


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with the rows split over ``group``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None,
                 sequence_parallel: bool = False, seed: int = 0):
        super().__init__()
        t, r = size_and_rank(group)
        per_rank = divide(num_embeddings, t, "vocab_size (num_embeddings)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.start, self.end = r * per_rank, (r + 1) * per_rank
        self.group, self.sequence_parallel = group, sequence_parallel
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full = torch.randn(num_embeddings, embedding_dim)
        self.weight = nn.Parameter(full[self.start:self.end].clone())

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """This rank's rows of an existing single-device ``nn.Embedding``."""
        with torch.device(emb.weight.device):  # built where the embedding lives
            m = cls(emb.num_embeddings, emb.embedding_dim, **kwargs)
        m.load_state_dict({"weight": emb.weight[m.start:m.end]})
        return m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:   # a plain error before any communication
            check_seq_len(idx.shape[1], self.group)
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return (reduce_scatter_seq if self.sequence_parallel else g)(partial, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.end})"
