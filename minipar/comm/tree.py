"""Broadcast and a latency-optimal all-reduce, from point-to-point calls.

* :func:`broadcast`, ``algorithm="tree"``: a binomial tree. The number of ranks that hold the
  data doubles each round, so all n ranks have it after ⌈log2 n⌉ rounds. ``"ring"``: a
  pipelined chain, the tensor cut in pieces that follow one another around the ring, about one
  transfer's time for a large message, however many ranks. Both send (n-1)·N elements in
  all; the tree puts ⌈log2 n⌉·N on the root.
* :func:`halving_doubling_all_reduce` (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005):
  reduce-scatter by recursive halving, all-gather by recursive doubling. The ring's 2(n-1)/n·N
  elements per rank in 2·log2(n) steps instead of 2(n-1): it wins when the per-message latency
  α dominates (small messages, many ranks).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from .p2p import exchange, group_rank, group_size, irecv, isend, recv


# Contract:
# ex01.*.src: ``broadcast`` copies group rank ``src``'s tensor (contiguous) to every rank of the
#     group in place, and returns it, from any src.
# ex01.*.tree: ``algorithm="tree"``: every rank but src receives the tensor once, whole, in one
#     message; src sends ⌈log2 n⌉ messages, and no rank is more than ⌈log2 n⌉ messages away
#     from src along the messages that brought it the tensor (⌈log2 n⌉ rounds).
# ex01.*.chain: ``algorithm="ring"``: the tensor goes around the ring from src in ``pieces``
#     pieces (as many as it has elements, if fewer): each rank but src receives every piece
#     once, from group rank r-1, and every rank but the one before src sends each piece once,
#     to r+1 ((n-1)·N elements in all); a rank forwards its first piece before it has
#     received its last (pipelined).
# ex01.*.algorithm: any other algorithm is a ValueError, on any group (a group of one rank too).
def broadcast(tensor: torch.Tensor, src: int = 0, group=None, algorithm: str = "tree",
              pieces: int = 4) -> torch.Tensor:
    """Copy ``tensor`` from group rank ``src`` to every rank of ``group`` in place."""
    # >>> ex01
    if algorithm not in ("tree", "ring"):  # before anything else: a group of one rank too
        raise ValueError(f"algorithm must be 'tree' or 'ring', got {algorithm!r}")
    n, r = group_size(group), group_rank(group)
    if n == 1:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor")
    flat, vr = tensor.view(-1), (r - src) % n  # vr: rank relative to the root
    if algorithm == "tree":
        for k in range((n - 1).bit_length()):  # round k, mask = 2^k
            mask = 1 << k
            if vr < mask and vr + mask < n:
                isend(flat, (vr + mask + src) % n, group, name="broadcast", round=k).wait()
            elif mask <= vr < 2 * mask:
                recv(flat, (vr - mask + src) % n, group, name="broadcast", round=k)
    elif algorithm == "ring":
        left, right, sends = (r - 1) % n, (r + 1) % n, []
        for i, piece in enumerate(flat.tensor_split(min(pieces, max(flat.numel(), 1)))):
            if vr > 0:
                irecv(piece, left, group, name="broadcast", piece=i).wait()
            if vr < n - 1:
                sends.append(isend(piece, right, group, name="broadcast", piece=i))
        for h in sends:
            h.wait()
    return tensor
    # <<< ex01


def halving_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` (a power-of-two number of ranks) in place by recursive
    halving and doubling: at distance d = n/2, n/4, ..., 1 each rank pairs with ``r XOR d``,
    keeps one half of its current segment, sends the other half and adds what it receives;
    then the steps run backwards, exchanging the reduced halves."""
    n, r = group_size(group), group_rank(group)
    if n & (n - 1):
        raise ValueError(f"halving_doubling_all_reduce needs a power-of-two group, got {n} ranks")
    if not tensor.is_contiguous():
        raise ValueError("halving_doubling_all_reduce needs a contiguous tensor")
    flat = tensor.view(-1)
    offs = list(accumulate((c.numel() for c in flat.tensor_split(n)), initial=0))

    def seg(lo, hi):
        return flat[offs[lo]:offs[hi]]

    lo, hi, steps = 0, n, []
    for d in (n >> k for k in range(1, n.bit_length())):  # n/2, n/4, ..., 1
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
        buf = torch.empty_like(seg(*keep))
        exchange(seg(*give), r ^ d, buf, r ^ d, group, name="halving_doubling_all_reduce",
                 distance=d, phase="reduce-scatter")
        seg(*keep).add_(buf)
        steps.append((d, keep, give))
        lo, hi = keep
    for d, keep, give in reversed(steps):
        exchange(seg(*keep), r ^ d, seg(*give), r ^ d, group, name="halving_doubling_all_reduce",
                 distance=d, phase="all-gather")
    return tensor
