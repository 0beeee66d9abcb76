"""The all-to-all as a differentiable operation (its backward written out).

Forward: chunk j of the input (``send[j]`` rows) goes to rank j; the output is the chunks
that arrive, in rank order (``recv[i]`` rows from rank i). A permutation of rows across ranks,
so its transpose, which the backward applies to the gradient, is the same exchange the other
way, split sizes swapped: each arrived row's gradient goes back where the row came from.

    y = A2A(x; recv, send)        ∂L/∂x = A2A(∂L/∂y; send, recv)

(GShard's dispatch and combine, Lepikhin et al. 2020; recorded by :mod:`minipar.comm` as
``<name>`` and ``<name>_backward``.)
"""
from __future__ import annotations

import torch

from .. import comm


def exchange(x: torch.Tensor, recv: list[int], send: list[int], group=None, name: str = "all_to_all",
             **labels) -> torch.Tensor:
    """One recorded ``all_to_all_single``: ``x`` has ``sum(send)`` rows, the result ``sum(recv)``."""
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
