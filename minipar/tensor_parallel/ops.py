"""The communication operators of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, Section 3, Figure 3) splits the matrix multiplies of a
layer across the t ranks of a tensor-parallel group and wraps each parallel region in two
conjugate operators:

    f   forward: identity      backward: all-reduce    (enters a region: every rank reads
                                                         the same X, so dL/dX sums the
                                                         ranks' partial gradients)
    g   forward: all-reduce    backward: identity      (leaves a region: the partial
                                                         outputs sum to Y; dL/dY is already
                                                         the same on every rank)

Sequence parallelism (Korthikanti et al. 2022, Section 4.2.2) cuts each all-reduce into its
two halves along the sequence dimension, again as a conjugate pair:

    all_gather        forward: all-gather        backward: reduce-scatter
    reduce_scatter    forward: reduce-scatter    backward: all-gather

Two data-movement operators complete the set: :func:`gather` (forward all-gather,
backward keep this rank's slice) for ``ColumnParallelLinear(gather_output=True)`` and
:func:`split` (forward keep this rank's slice, backward all-gather), its mirror image.

Everything moves through :mod:`minipar.comm` (flat tensors, recorded with ring bytes), and
ranks are local to ``group`` (``None``: the world), so the operators compose with other
process groups.
"""
from __future__ import annotations

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


# ---------------------------------------------------------------- collectives on any dim
# The collectives below work on any dimension with minipar.comm's flat tensors; they are
# plain functions (no autograd), used by the autograd Functions after them.
def _sum(x: torch.Tensor, group=None, name: str = "all_reduce") -> torch.Tensor:
    """A summed copy of ``x`` over ``group`` (the input is left alone)."""
    # >>> ex05 A
    # Hint: comm.all_reduce(out, group=group, name=name) on a contiguous clone: x stays as it was.
    out = x.clone(memory_format=torch.contiguous_format)
    if comm.group_size(group) > 1:
        comm.all_reduce(out, group=group, name=name)
    return out
    # <<< ex05 A


def _all_gather(x: torch.Tensor, dim: int, group=None, name: str = "all_gather") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order (one flat all-gather)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    xt = x.movedim(dim, 0).contiguous()          # rank r's block becomes a flat run
    out = torch.empty(n * xt.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(out, xt.reshape(-1), group=group, name=name)
    return out.view(n * xt.shape[0], *xt.shape[1:]).movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group=None, name: str = "reduce_scatter") -> torch.Tensor:
    """This rank's block (along ``dim``) of the sum of ``x`` over ``group``."""
    n = comm.group_size(group)
    if n == 1:
        return x
    divide(x.shape[dim], n, f"size along dim {dim}")
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty(xt.numel() // n, dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, xt.reshape(-1), group=group, name=name)
    return out.view(xt.shape[0] // n, *xt.shape[1:]).movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication)."""
    n, r = size_and_rank(group)
    if n == 1:
        return x
    divide(x.shape[dim], n, f"size along dim {dim}")
    return x.chunk(n, dim)[r].contiguous()


# ---------------------------------------------------------------- Megatron's f and g
class _F(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        # >>> ex05 A
        # Hint: the identity: keep group and name in ctx for the backward; return x.view_as(x).
        ctx.group, ctx.name = group, name
        return x.view_as(x)
        # <<< ex05 A

    @staticmethod
    def backward(ctx, grad):
        # >>> ex05 A
        # Hint: sum the ranks' gradients with _sum; one gradient per forward input: (dx, None, None).
        return _sum(grad, ctx.group, ctx.name), None, None
        # <<< ex05 A


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # >>> ex05 A
        # Hint: g sums the ranks' partial results: an all-reduced copy of x (never modify x itself).
        return _sum(x, group, "g.all_reduce")
        # <<< ex05 A

    @staticmethod
    def backward(ctx, grad):
        # >>> ex05 A
        # Hint: dL/dY is already the same on every rank: pass it through.
        return grad, None
        # <<< ex05 A


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: ``x`` unchanged forward; the gradient is all-reduced over ``group``."""
    return _F.apply(x, group, "f.all_reduce")


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the sum of ``x`` over ``group`` forward; the gradient passes unchanged."""
    return _G.apply(x, group)


def sync_grad(p: torch.Tensor, group=None) -> torch.Tensor:
    """f applied to a replicated parameter used on a slice of the data (sequence
    parallelism's layer norms and biases): each rank's gradient is partial, f sums it."""
    return _F.apply(p, group, "sp.param_grad")


# ---------------------------------------------------------------- the all-gather / reduce-scatter pair
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "sp.all_gather")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, "sp.reduce_scatter"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group, "sp.reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "sp.all_gather"), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "gather")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "split.all_gather"), None, None


def all_gather(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Forward all-gather along ``dim``; backward reduce-scatter (sequence parallelism's g)."""
    return _AllGather.apply(x, dim, group)


def reduce_scatter(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Forward reduce-scatter along ``dim``; backward all-gather (sequence parallelism's ḡ)."""
    return _ReduceScatter.apply(x, dim, group)


def gather(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Forward all-gather along ``dim``; backward keeps this rank's slice of the gradient."""
    return _Gather.apply(x, dim, group)


def split(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Forward keeps this rank's slice along ``dim``; backward all-gathers the gradient."""
    return _Split.apply(x, dim, group)
