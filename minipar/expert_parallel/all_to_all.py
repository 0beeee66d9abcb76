"""The all-to-all as a differentiable operation: GShard's dispatch and combine (Lepikhin et
al. 2020), recorded by :mod:`minipar.comm`. Its contract is exercise 09 C's.
"""
from __future__ import annotations

import torch

from .. import comm


# Contract:
# Given: ``x`` holds ``sum(send)`` rows, the first ``send[0]`` for group rank 0 and so on.
# ex09.C.order: the result holds ``sum(recv)`` rows, the rows arriving in rank order (group rank
#     0's first).
# ex09.C.empty: a rank may send or receive no rows.
# ex09.C.dtype: each dtype kept (float64 and bfloat16 in, the same dtype out).
# ex09.C.backward: in backward each arrived row's gradient goes back where the row came from.
# ex09.C.named: ``all_to_all(..., name=...)`` is recorded under ``name`` forward and
#     ``name + "_backward"`` backward, with the ``**labels`` it is given.
def exchange(x: torch.Tensor, recv: list[int], send: list[int], group=None, name: str = "all_to_all",
             **labels) -> torch.Tensor:
    """Rows of ``x`` for the group's ranks (``send[j]`` for rank j), rows from them (``recv[i]``
    from rank i): contract ex09.C."""
    # >>> ex09 C
    out = x.new_empty(sum(recv), *x.shape[1:])
    comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, name=name, **labels)
    return out
    # <<< ex09 C


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recv, send, group, name, labels):
        # >>> ex09 C
        ctx.recv, ctx.send, ctx.group, ctx.name, ctx.labels = recv, send, group, name, labels
        return exchange(x, recv, send, group, name, **labels)
        # <<< ex09 C

    @staticmethod
    def backward(ctx, grad):
        # >>> ex09 C
        g = exchange(grad, ctx.send, ctx.recv, ctx.group, ctx.name + "_backward", **ctx.labels)
        return g, None, None, None, None, None
        # <<< ex09 C


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group=None, name: str = "all_to_all",
               **labels) -> torch.Tensor:
    """Differentiable all-to-all: rows ``x`` split by ``send`` go out, ``recv`` rows per rank arrive."""
    return AllToAll.apply(x, list(recv), list(send), group, name, labels)
