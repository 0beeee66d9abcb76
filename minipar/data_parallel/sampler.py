"""Sharding the data: each rank reads its own slice of every global batch.

The single process reads global batch k as ``perm[k·B:(k+1)·B]`` of a per-epoch permutation;
rank r of n reads its r-th contiguous ``B/n`` indices. The shards are disjoint, make the
single-process batch in rank order, and depend only on ``(seed, epoch, step)``: no rank talks to
another about data. ``torch.utils.data.DistributedSampler`` interleaves instead (same sets per
step, another order); keeping the order makes the equivalence with one process exact.
"""
from __future__ import annotations

import torch

from .. import comm
from ..data import shard


class ShardedBatchSampler:
    """Yields, for each step of an epoch, this rank's list of dataset indices.
    ``num_samples``: dataset size; ``global_batch_size``: B (divisible by the group's size);
    ``shuffle``: permute per epoch with ``seed`` (call :meth:`set_epoch`); ``drop_last``: drop
    a final incomplete global batch (else it is cut evenly, any remainder dropped, so only
    ``drop_last`` gives B samples every step). Use as ``DataLoader(dataset, batch_sampler=...)``."""

    def __init__(self, num_samples: int, global_batch_size: int, group=None, rank: int | None = None,
                 num_replicas: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        self.n = num_replicas if num_replicas is not None else comm.group_size(group)
        self.rank = rank if rank is not None else comm.group_rank(group)
        if global_batch_size % self.n:
            raise ValueError(f"global batch {global_batch_size} is not divisible by {self.n} ranks")
        if not 0 <= self.rank < self.n:
            raise ValueError(f"rank {self.rank} is not in 0..{self.n - 1}")
        self.num_samples, self.B = num_samples, global_batch_size
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        """Use a different (deterministic) permutation for each epoch."""
        self.epoch = epoch

    def global_batches(self) -> list[list[int]]:
        """The single-process batches of this epoch (the same on every rank)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=g, device="cpu").tolist()
        else:
            order = list(range(self.num_samples))
        out = [order[i:i + self.B] for i in range(0, self.num_samples, self.B)]
        if out and len(out[-1]) < self.B:
            last = out.pop()
            keep = len(last) - len(last) % self.n
            if not self.drop_last and keep:
                out.append(last[:keep])
        return out

    def __iter__(self):
        for batch in self.global_batches():
            yield shard(torch.tensor(batch, device="cpu"), self.rank, self.n).tolist()

    def __len__(self) -> int:
        return len(self.global_batches())


def shard_batch(batch, group=None):
    """This rank's piece of a global batch (a tensor or a tuple of tensors), along dim 0."""
    n, r = comm.group_size(group), comm.group_rank(group)
    if isinstance(batch, torch.Tensor):
        return shard(batch, r, n)
    return type(batch)(shard(t, r, n) for t in batch)
