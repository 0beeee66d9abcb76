"""Ring collectives built only from point-to-point sends and receives.

The ``n`` ranks sit on a ring; each talks only to its neighbours ``right = r+1`` and
``left = r-1`` (mod n). A flat tensor of N elements is cut into n chunks (``tensor_split``:
sizes differ by at most one element when n does not divide N), and every step moves one chunk
per rank, each rank sending to its right while it receives from its left.

* **Reduce-scatter** (n-1 steps): what a rank sends is a partial sum; after step s every rank
  holds, in one chunk, the sum of s+2 ranks' data. After n-1 steps chunk r on rank r holds the
  sum over all ranks.
* **All-gather** (n-1 steps): every rank starts with one chunk's final value, and each step
  spreads every final chunk one rank further.
* **All-reduce** = reduce-scatter + all-gather: 2(n-1) steps.

Each step moves one chunk (N/n elements) per rank, so per rank (Patarasuk & Yuan 2009;
``minipar.cost.collective_bytes``):

    reduce-scatter, all-gather:  (n-1)/n · N     all-reduce:  2 (n-1)/n · N

which is independent of n for large n: the reason the ring is bandwidth-optimal.
"""
from __future__ import annotations

import torch

from .p2p import exchange, group_rank, group_size


def _check_op(op: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be one of ('sum', 'avg'), got {op!r}")


# Contract:
# Given: ``chunks`` are the n views ``tensor_split(n)`` cuts the flattened tensor into, n the
#     group's size; ``minipar.comm.exchange`` (one send and one receive, recorded), ``isend``,
#     ``irecv`` and ``recv`` are the messages to build from.
# ex01.*.scatter: afterwards chunk r on rank r holds the sum of chunk r over all n ranks, in
#     place (the other chunks may hold anything).
# ex01.*.ring: ranks talk only to their neighbours on the ring: in every ring function, group
#     rank r sends only to group rank r+1 and receives only from r-1 (mod n).
# ex01.*.step: each half (this one and ``_all_gather_chunks``) is n-1 steps, and at each step
#     every rank sends exactly one message, one chunk: n-1 messages and (n-1)/n of the tensor
#     per rank per half, 2(n-1)/n of it for an all-reduce, whatever n
#     (``minipar.cost.collective_bytes``); nothing sent twice.
# ex01.*.group: every function works on any group (``None``: the world), a sub-group of the
#     ranks too: ranks, peers and chunk numbers are group ranks (``group_rank(group)``, 0..n-1),
#     which differ from the world's ``dist.get_rank()`` on a sub-group.
def _reduce_scatter_chunks(chunks: list[torch.Tensor], group, name: str) -> None:
    # >>> ex01
    n, r = group_size(group), group_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r - s - 1) % n, (r - s - 2) % n
        buf = torch.empty_like(chunks[recv_c])
        exchange(chunks[send_c], right, buf, left, group, name=name, step=s, phase="reduce-scatter")
        chunks[recv_c] += buf
    # <<< ex01


# Contract:
# Given: on rank r, chunk r holds a final value (the other chunks anything).
# ex01.*.gather: afterwards every rank holds every chunk's final value, in place (after
#     ``_reduce_scatter_chunks``: every chunk's full sum); n-1 messages per rank, as above.
def _all_gather_chunks(chunks: list[torch.Tensor], group, name: str) -> None:
    # >>> ex01
    n, r = group_size(group), group_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        buf = torch.empty_like(chunks[recv_c])
        exchange(chunks[send_c], right, buf, left, group, name=name, step=s, phase="all-gather")
        chunks[recv_c].copy_(buf)
    # <<< ex01


# Contract:
# ex01.*.in_place: ``ring_all_reduce`` sums ``tensor`` over the group's n ranks in place, and
#     returns that same tensor (shape kept); 2(n-1) messages per rank, the two halves'.
# ex01.*.avg: ``op="avg"`` divides by n, the size of the group.
# ex01.*.uneven: any size, also one that n does not divide (or smaller than n).
def ring_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """Sum (or average) ``tensor`` over the ranks of ``group`` in place; returns it.
    Reduce-scatter then all-gather: 2(n-1) steps, 2(n-1)/n·N elements sent per rank."""
    _check_op(op)
    # >>> ex01
    n = group_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    if n > 1:
        chunks = list(flat.tensor_split(n))
        _reduce_scatter_chunks(chunks, group, "ring_all_reduce")
        _all_gather_chunks(chunks, group, "ring_all_reduce")
    if op == "avg":
        flat /= n
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
    # <<< ex01


# Contract:
# ex01.*.input_kept: ``ring_reduce_scatter`` returns rank r's chunk r (of ``tensor_split(n)``)
#     of the sum (``op`` as above), a new tensor; the input tensor is left unchanged. n-1
#     messages per rank.
def ring_reduce_scatter(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """Rank r's chunk r (``tensor_split(n)`` of the flattened tensor) of the sum of ``tensor``
    over ``group``; ``tensor`` itself is left unchanged. (n-1)/n·N elements sent per rank."""
    _check_op(op)
    # >>> ex01
    n, r = group_size(group), group_rank(group)
    chunks = [c.clone() for c in tensor.reshape(-1).tensor_split(n)]
    if n > 1:
        _reduce_scatter_chunks(chunks, group, "ring_reduce_scatter")
    return chunks[r] / n if op == "avg" else chunks[r]
    # <<< ex01


# Contract:
# ex01.*.sizes: ``ring_all_gather`` returns every rank's chunk concatenated in rank order (a new
#     1-D tensor), chunks of different sizes too when ``sizes`` lists them; n-1 messages per
#     rank, (N - its own chunk) elements received, N the gathered size.
# ex01.*.size_check: sizes that do not match this rank's chunk are a ValueError, raised before
#     anything is sent.
def ring_all_gather(chunk: torch.Tensor, group=None, sizes: list[int] | None = None) -> torch.Tensor:
    """Every rank's flattened ``chunk`` concatenated in rank order (1-D). Chunks may differ in
    size (Gloo's own ``all_gather`` refuses that): pass ``sizes``, the elements each rank
    contributes (``None``: all equal). (n-1)/n·N elements sent per rank, N the gathered size."""
    # >>> ex01
    n, r = group_size(group), group_rank(group)
    sizes = sizes or [chunk.numel()] * n
    if len(sizes) != n or sizes[r] != chunk.numel():
        raise ValueError(f"sizes={sizes} does not match {n} ranks / this rank's {chunk.numel()} elements")
    out = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)
    chunks = list(out.split(sizes))
    chunks[r].copy_(chunk.reshape(-1))
    if n > 1:
        _all_gather_chunks(chunks, group, "ring_all_gather")
    return out
    # <<< ex01
