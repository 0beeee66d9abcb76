"""The communication operators of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, Section 3, Figure 3) splits a layer's matrix multiplies
over the t ranks of a tensor-parallel group and wraps each parallel region in two
conjugate operators:

    f   enters a parallel region: every rank reads the same X
    g   leaves it: every rank holds a partial result of Y

Sequence parallelism (Korthikanti et al. 2022, Section 4.2.2) cuts each all-reduce into its
two halves along the sequence, again a conjugate pair: :func:`all_gather` (backward
reduce-scatter) and :func:`reduce_scatter` (backward all-gather). :func:`gather` (backward
keeps this rank's slice; for ``ColumnParallelLinear(gather_output=True)``) and its mirror
:func:`split` complete the set.
Everything goes through :mod:`minipar.comm` (flat tensors, recorded with ring bytes), with ranks
local to ``group`` (``None``: the world), so the operators compose with other process groups.
"""
from __future__ import annotations

from functools import partial

import torch

from .. import comm


def size_and_rank(group=None) -> tuple[int, int]:
    """(t, r): the size of the tensor-parallel ``group`` and this rank's index in it."""
    return comm.group_size(group), comm.group_rank(group)


def divide(n: int, t: int, what: str) -> int:
    """``n // t``, or a plain ``ValueError`` naming ``what`` when ``t`` does not divide ``n``."""
    if n % t:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size t={t}")
    return n // t


# ---------------------------------------------------------------- collectives on any dim (no autograd)
# Contract:
# Given: ``_sum``, ``gather_along`` and ``_split`` are the plain collectives behind the autograd
#     operators ``f``, ``g``, ``gather`` and ``split``; ``_sum(x, group, name)`` returns the sum of
#     ``x`` over the group's ranks.
# ex05.A.inplace: no operator modifies a tensor autograd gave it (``_sum``'s input included).
# ex05.*.group: on a non-world group (two groups of 2 out of 4 ranks, [0, 2] and [1, 3]) every
#     group computes its own layer: only its ranks take part and ranks count within it
#     (``size_and_rank(group)``).
# ex05.*.recorded: every collective goes through ``minipar.comm``, so the trace records its bytes
#     (its all-gather and reduce-scatter take flat tensors).
def _sum(x: torch.Tensor, group=None, name: str = "all_reduce") -> torch.Tensor:
    """A summed copy of ``x`` over ``group`` (the input is left alone)."""
    # >>> ex05 A
    out = x.clone(memory_format=torch.contiguous_format)
    if comm.group_size(group) > 1:
        comm.all_reduce(out, group=group, name=name)
    return out
    # <<< ex05 A


# Contract:
# ex05.A.gather: ``gather_along(x, dim, group)`` returns every rank's ``x`` concatenated along
#     ``dim`` in rank order (any ``dim``, negative too), in one collective.
def gather_along(x: torch.Tensor, dim: int, group=None, name: str = "all_gather") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order (one flat all-gather)."""
    # >>> ex05 A
    n = comm.group_size(group)
    if n == 1:
        return x
    xt = x.movedim(dim, 0).contiguous()          # rank r's block becomes a flat run
    out = torch.empty(n * xt.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(out, xt.reshape(-1), group=group, name=name)
    return out.view(n * xt.shape[0], *xt.shape[1:]).movedim(0, dim).contiguous()
    # <<< ex05 A


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None, name: str = "reduce_scatter") -> torch.Tensor:
    """This rank's block (along ``dim``) of the sum of ``x`` over ``group``."""
    n = comm.group_size(group)
    if n == 1:
        return x
    divide(x.shape[dim], n, f"size along dim {dim}")
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty(xt.numel() // n, dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, xt.reshape(-1), group=group, name=name)
    return out.view(xt.shape[0] // n, *xt.shape[1:]).movedim(0, dim).contiguous()


# Contract:
# ex05.A.split: ``_split(x, dim, group)`` returns this rank's block of ``x`` along ``dim``, the
#     blocks in rank order, without communicating.
# ex05.A.divide: a size along ``dim`` that t does not divide is a ``ValueError``.
def _split(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication)."""
    # >>> ex05 A
    n, r = size_and_rank(group)
    if n == 1:
        return x
    divide(x.shape[dim], n, f"size along dim {dim}")
    return x.chunk(n, dim)[r].contiguous()
    # <<< ex05 A


# ---------------------------------------------------------------- Megatron's f and g
class _F(torch.autograd.Function):
    """Megatron's f: where a parallel region begins (every rank reads the same tensor)."""

    # Contract:
    # ex05.A.f: ``f(x, group)`` (``_F``) stands where every rank of the group reads the same ``x``
    #     (in front of a column-parallel layer): its output equals ``x``, and the gradient it
    #     returns is the whole ∂L/∂x, the same on every rank, although each rank's layer saw only
    #     its part of the computation.
    # ex05.A.bytes: each use of ``f`` or ``g`` sends one all-reduce of the tensor, in the direction
    #     that needs it, and nothing in the other; it is recorded under the ``name`` the operator
    #     is given (``f`` gives "f.all_reduce", ``g`` "g.all_reduce").
    @staticmethod
    def forward(ctx, x, group, name):
        # >>> ex05 A
        ctx.group, ctx.name = group, name
        return x.view_as(x)
        # <<< ex05 A

    @staticmethod
    def backward(ctx, grad):
        # >>> ex05 A
        return _sum(grad, ctx.group, ctx.name), None, None
        # <<< ex05 A


class _G(torch.autograd.Function):
    """Megatron's g: where a parallel region ends (each rank holds a partial result)."""

    # Contract:
    # ex05.A.g: ``g(x, group)`` (``_G``) stands where each rank holds a partial result (behind a
    #     row-parallel layer): its output is the whole result on every rank, and the gradient it
    #     returns is the one each rank's partial result needs.
    @staticmethod
    def forward(ctx, x, group, name):
        # >>> ex05 A
        return _sum(x, group, name)
        # <<< ex05 A

    @staticmethod
    def backward(ctx, grad):
        # >>> ex05 A
        return grad, None, None
        # <<< ex05 A


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f, where a parallel region over ``group`` begins: every rank reads the same
    ``x``, and the gradient it returns is the whole ∂L/∂x on every rank (contract ex05.A.f)."""
    return _F.apply(x, group, "f.all_reduce")


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g, where a parallel region over ``group`` ends: each rank's ``x`` is a partial
    result, the output is the whole result on every rank (contract ex05.A.g)."""
    return _G.apply(x, group, "g.all_reduce")


def sync_grad(p: torch.Tensor, group=None) -> torch.Tensor:
    """f applied to a replicated parameter used on a slice of the data (sequence
    parallelism's layer norms and biases), so its gradient is the whole ∂L/∂p on every rank."""
    return _F.apply(p, group, "sp.param_grad")


# ---------------------------------------------------------------- the all-gather / reduce-scatter pair
class _Conjugate(torch.autograd.Function):
    """Forward ``fwd(x, dim, group)``, backward ``bwd(grad, dim, group)``: the four pairs below."""

    @staticmethod
    def forward(ctx, x, dim, group, fwd, bwd):
        ctx.dim, ctx.group, ctx.bwd = dim, group, bwd
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.dim, ctx.group), None, None, None, None


def all_gather(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Forward all-gather along ``dim``; backward reduce-scatter (sequence parallelism's g)."""
    return _Conjugate.apply(x, dim, group, partial(gather_along, name="sp.all_gather"),
                            partial(reduce_scatter_along, name="sp.reduce_scatter"))


def reduce_scatter(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Forward reduce-scatter along ``dim``; backward all-gather (sequence parallelism's ḡ)."""
    return _Conjugate.apply(x, dim, group, partial(reduce_scatter_along, name="sp.reduce_scatter"),
                            partial(gather_along, name="sp.all_gather"))


def gather(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Forward all-gather along ``dim``; backward keeps this rank's slice of the gradient."""
    return _Conjugate.apply(x, dim, group, partial(gather_along, name="gather"), _split)


def split(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Forward keeps this rank's slice along ``dim``; backward all-gathers the gradient."""
    return _Conjugate.apply(x, dim, group, _split, partial(gather_along, name="split.all_gather"))
