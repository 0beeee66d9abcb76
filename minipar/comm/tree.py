"""Broadcast and a latency-optimal all-reduce, from point-to-point calls.

* :func:`broadcast` with ``algorithm="tree"``: a binomial tree. In round k every rank that
  already has the data sends it to the rank 2^k places further on, so all n ranks have
  it after ⌈log2 n⌉ rounds.
* ``algorithm="ring"``: a pipelined chain. The data is cut into pieces; each rank passes
  piece i to its right neighbour while receiving piece i+1. For large messages this takes
  about the time of one transfer, however many ranks there are.

  Both send (n-1)·N elements in total; the tree concentrates ⌈log2 n⌉·N on the root.
* :func:`halving_doubling_all_reduce` (Rabenseifner 2004; Thakur, Rabenseifner & Gropp
  2005): reduce-scatter by recursive halving, then all-gather by recursive doubling. Same
  2(n-1)/n·N elements per rank as the ring, but in 2·log2(n) steps instead of 2(n-1): it
  wins when the per-message latency α dominates (small messages, many ranks).
"""
from __future__ import annotations

import torch

from .p2p import exchange, group_rank, group_size, irecv, isend, recv


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, algorithm: str = "tree",
              pieces: int = 4) -> torch.Tensor:
    """Copy ``tensor`` from group rank ``src`` to every rank of ``group`` in place."""
    n, r = group_size(group), group_rank(group)
    if n == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else None
    if flat is None:
        raise ValueError("broadcast needs a contiguous tensor")
    vr = (r - src) % n  # rank relative to the root
    if algorithm == "tree":
        mask = 1
        while mask < n:
            if vr < mask and vr + mask < n:
                isend(flat, (vr + mask + src) % n, group, name="broadcast", round=mask.bit_length() - 1).wait()
            elif mask <= vr < 2 * mask:
                recv(flat, (vr - mask + src) % n, group, name="broadcast", round=mask.bit_length() - 1)
            mask *= 2
    elif algorithm == "ring":
        left, right = (r - 1) % n, (r + 1) % n
        sends = []
        for i, piece in enumerate(flat.tensor_split(min(pieces, max(flat.numel(), 1)))):
            if vr > 0:
                irecv(piece, left, group, name="broadcast", piece=i).wait()
            if vr < n - 1:
                sends.append(isend(piece, right, group, name="broadcast", piece=i))
        for h in sends:
            h.wait()
    else:
        raise ValueError(f"algorithm must be 'tree' or 'ring', got {algorithm!r}")
    return tensor


def halving_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place with recursive halving and doubling.

    Needs a power-of-two number of ranks. At distance d = n/2, n/4, ..., 1 each rank pairs
    with ``r XOR d``, keeps one half of its current segment, sends the other half and adds
    what it receives; then the steps run backwards, exchanging the reduced halves.
    """
    n, r = group_size(group), group_rank(group)
    if n & (n - 1):
        raise ValueError(f"halving_doubling_all_reduce needs a power-of-two group, got {n} ranks")
    if not tensor.is_contiguous():
        raise ValueError("halving_doubling_all_reduce needs a contiguous tensor")
    flat = tensor.view(-1)
    sizes = [c.numel() for c in flat.tensor_split(n)]
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)

    def seg(lo, hi):
        return flat[offs[lo]:offs[hi]]

    lo, hi, d, steps = 0, n, n // 2, []
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
        buf = torch.empty_like(seg(*keep))
        exchange(seg(*give), r ^ d, buf, r ^ d, group, name="halving_doubling_all_reduce",
                 distance=d, phase="reduce-scatter")
        seg(*keep).add_(buf)
        steps.append((d, keep, give))
        lo, hi = keep
        d //= 2
    for d, keep, give in reversed(steps):
        exchange(seg(*keep), r ^ d, seg(*give), r ^ d, group, name="halving_doubling_all_reduce",
                 distance=d, phase="all-gather")
    return tensor
