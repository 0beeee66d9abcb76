"""Cutting a batch's sequence across the context-parallel ranks, and putting it back.

Two layouts of ``T`` tokens over ``c`` ranks:

* ``"contiguous"``: rank r holds tokens [r·T/c, (r+1)·T/c). Under a causal mask the ranks
  do 1, 2, ..., c blocks of work (rank 0's queries see one block of keys): the imbalance.
* ``"zigzag"``: 2c chunks of T/(2c), two per rank (:func:`zigzag_chunks`), so that under a
  causal mask every rank does the same work (Brandon et al. 2023, "Striped attention"; the
  zigzag layout of ring-flash-attention and Llama 3's context parallelism, Dubey et al. 2024
  §3.3.2).

:func:`sequence_positions` gives every local token's global position, which the position
embedding and the causal mask use.
"""
from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_sequence(T: int, cp: int, layout: str = "contiguous") -> None:
    """Plain ``ValueError`` unless ``T`` tokens cut evenly over ``cp`` ranks in ``layout``
    (T divisible by cp, or by 2·cp for zigzag). Uneven blocks are not supported."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    parts = 2 * cp if layout == "zigzag" else cp
    if T % parts:
        raise ValueError(f"sequence length T={T} cannot be cut into {parts} equal chunks ({layout} sharding "
                         f"over cp={cp}{', 2·cp chunks' if layout == 'zigzag' else ''}); uneven blocks are "
                         f"not supported: choose T divisible by {parts}")


# Contract:
# Given: the sequence is cut into 2·cp equal chunks, numbered 0 .. 2·cp-1 in sequence order;
#     each rank of a cp group holds two of them.
# ex08.B.cover: the result is the two chunk numbers ``rank`` holds, the earlier first, and
#     together the ranks 0 .. cp-1 hold each chunk exactly once.
# ex08.B.balance: under a causal mask every rank's queries do the same attention work (the
#     query-key pairs they score), for every cp.
# ex08.B.range: a rank outside 0 .. cp-1 is a ``ValueError``.
def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp, earlier first) that ``rank`` holds under zigzag sharding: one
    early and one late, so that every rank's causal attention work is the same."""
    # >>> ex08 B
    # Hint: a rank outside 0 .. cp-1 is a ValueError.
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a cp group of {cp}")
    return rank, 2 * cp - 1 - rank
    # <<< ex08 B


def chunk_ids(rank: int, cp: int, layout: str = "contiguous") -> list[int]:
    """Chunks of the sequence ``rank`` holds, in local order: ``[r]`` of ``cp`` chunks
    (contiguous) or :func:`zigzag_chunks` of ``2·cp`` chunks (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return list(zigzag_chunks(rank, cp)) if layout == "zigzag" else [rank]


def sequence_positions(T: int, rank: int, cp: int, layout: str = "contiguous", device=None) -> torch.Tensor:
    """Global positions (int64, length T/cp) of the tokens ``rank`` holds."""
    return shard_sequence(torch.arange(T, device=device), rank, cp, layout, dim=0)


def shard_sequence(t: torch.Tensor, rank: int, cp: int, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` along ``dim`` (the sequence dimension)."""
    check_sequence(t.shape[dim], cp, layout)
    n = 2 * cp if layout == "zigzag" else cp
    chunks = t.chunk(n, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, layout)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of :func:`shard_sequence`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    chunks = [None] * (2 * len(shards))
    for r, s in enumerate(shards):
        i, j = zigzag_chunks(r, len(shards))
        chunks[i], chunks[j] = s.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
