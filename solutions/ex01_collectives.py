"""Exercise 01, solved: the ring all-reduce, from point-to-point messages.

Reduce-scatter then all-gather around the ring; see ``exercises/ex01_collectives.py`` for
the statement and ``minipar/comm/ring.py`` for the library's version.
"""
import torch

from minipar.comm import exchange, group_rank, group_size


def ring_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or average (``op="avg"``) ``tensor`` over all ranks of ``group``,
    in place, and return it. Works for any number of ranks and any tensor size."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    n, r = group_size(group), group_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    work = tensor.detach().clone().reshape(-1)   # a flat, contiguous working copy
    chunks = work.tensor_split(n)                # views into `work`, sizes differ by <= 1

    # 1. reduce-scatter: after n-1 steps, chunks[r] is the sum of everyone's chunk r
    for step in range(n - 1):
        outgoing = chunks[(r - step - 1) % n]
        target = chunks[(r - step - 2) % n]
        incoming = torch.empty_like(target)
        exchange(outgoing, right, incoming, left, group, name="ring_all_reduce")
        target += incoming

    # 2. all-gather: pass the finished chunks around until everyone has all of them
    for step in range(n - 1):
        outgoing = chunks[(r - step) % n]
        target = chunks[(r - step - 1) % n]
        incoming = torch.empty_like(target)
        exchange(outgoing, right, incoming, left, group, name="ring_all_reduce")
        target.copy_(incoming)

    if op == "avg":
        work /= n
    tensor.copy_(work.view_as(tensor))
    return tensor
