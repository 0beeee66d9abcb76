"""Cutting a batch's sequence across the context-parallel ranks, and putting it back.

Two layouts of ``T`` tokens over ``c`` ranks:

* ``"contiguous"``: rank r holds tokens [r·T/c, (r+1)·T/c). Simple, but under a causal
  mask rank 0's queries see only one block of keys and rank c-1's see all c: the ranks
  do 1, 2, ..., c blocks of work (the causal imbalance).
* ``"zigzag"``: the sequence is cut into 2c chunks of T/(2c) and rank r holds chunks r and
  2c-1-r (Brandon et al. 2023, "Striped attention"; the zigzag layout of ring-flash-attention
  and Llama 3's context parallelism, Dubey et al. 2024 §3.3.2). Every rank holds one early and
  one late chunk, so every rank does the same causal work.

Positions follow the tokens: :func:`sequence_positions` gives the global position of every
local token, which the position embedding and the causal mask use.
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
        raise ValueError(f"sequence length T={T} cannot be cut into {parts} equal chunks "
                         f"({layout} sharding over cp={cp}" + (", 2·cp chunks" if layout == "zigzag" else "")
                         + "); uneven blocks are not supported: choose T divisible by "
                         f"{parts}")


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that ``rank`` holds under zigzag sharding: ``(r, 2c-1-r)``."""
    # >>> ex08 B
    # Hint: a rank outside 0 .. cp-1 is a ValueError; then one chunk from the front half of the
    # Hint: sequence and its mirror image from the back half.
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a cp group of {cp}")
    return rank, 2 * cp - 1 - rank
    # <<< ex08 B


def chunk_ids(rank: int, cp: int, layout: str = "contiguous") -> list[int]:
    """Chunks of the sequence ``rank`` holds, in local order: ``[r]`` of ``cp`` chunks
    (contiguous) or ``[r, 2c-1-r]`` of ``2·cp`` chunks (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return list(zigzag_chunks(rank, cp)) if layout == "zigzag" else [rank]


def sequence_positions(T: int, rank: int, cp: int, layout: str = "contiguous",
                       device=None) -> torch.Tensor:
    """Global positions (int64, length T/cp) of the tokens ``rank`` holds."""
    check_sequence(T, cp, layout)
    n = 2 * cp if layout == "zigzag" else cp
    size = T // n
    return torch.cat([torch.arange(i * size, (i + 1) * size, device=device)
                      for i in chunk_ids(rank, cp, layout)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` along ``dim`` (the sequence dimension)."""
    check_sequence(t.shape[dim], cp, layout)
    n = 2 * cp if layout == "zigzag" else cp
    chunks = t.chunk(n, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, layout)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], layout: str = "contiguous",
                     dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of
    :func:`shard_sequence`."""
    cp = len(shards)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    chunks = [None] * (2 * cp)
    for r, s in enumerate(shards):
        a, b = s.chunk(2, dim=dim)
        i, j = zigzag_chunks(r, cp)
        chunks[i], chunks[j] = a, b
    return torch.cat(chunks, dim=dim)
