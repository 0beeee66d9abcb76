"""Exercise 05, solved: f and g, column- and row-parallel linear layers, and the
vocabulary-parallel cross-entropy.

See ``exercises/ex05_tensor_parallel.py`` for the statement and ``minipar/tensor_parallel``
for the library's versions (whose cross-entropy writes the backward by hand instead).
"""
import torch
import torch.nn.functional as F

from minipar.comm import all_gather, all_reduce, group_rank, group_size
from minipar.tensor_parallel import gather


def _summed_copy(t: torch.Tensor, group) -> torch.Tensor:
    out = t.clone(memory_format=torch.contiguous_format)
    all_reduce(out, group=group)
    return out


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)            # identity

    @staticmethod
    def backward(ctx, grad):
        return _summed_copy(grad, ctx.group), None   # every rank's partial dL/dx, summed


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _summed_copy(x, group)  # the partial results, summed

    @staticmethod
    def backward(ctx, grad):
        return grad, None              # dL/dY is already the same on every rank


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: ``x`` unchanged forward; the gradient is all-reduced over ``group``."""
    return _F.apply(x, group)


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the sum of ``x`` over ``group`` forward; the gradient passes unchanged."""
    return _G.apply(x, group)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           gather_output: bool = False, group=None) -> torch.Tensor:
    """``f(x) A_iᵀ + b_i`` with this rank's rows of the weight (its output features).

    ``weight`` is (out/t, in), ``bias`` (out/t,). Returns this rank's output features, or
    all of them (all-gathered along the last dimension) with ``gather_output=True``."""
    y = F.linear(f(x, group), weight, bias)
    return gather(y, -1, group) if gather_output else y


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group=None) -> torch.Tensor:
    """``g(x_i A_iᵀ) + b``: this rank's input features ``x_i`` times its columns of the
    weight (out, in/t), summed over the group; the full bias (out,) is added once."""
    y = g(F.linear(x, weight), group)
    return y if bias is None else y + bias   # after the sum: added once, not t times


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy of (..., V/t) vocabulary-parallel logits against (...) targets,
    equal to ``F.cross_entropy`` on the full logits; never gathers the logits."""
    t, r = group_size(group), group_rank(group)
    z = logits.reshape(-1, logits.shape[-1])
    y = targets.reshape(-1)
    n, v = z.shape

    # the global max of each row (a constant: no gradient needed), from every rank's maxima
    local_max = z.detach().max(dim=-1).values.contiguous()
    maxima = torch.empty(t * n, dtype=z.dtype)
    all_gather(maxima, local_max, group=group)
    z = z - maxima.view(t, n).max(dim=0).values.unsqueeze(1)

    # Σ exp over the whole vocabulary, and the target's logit from the rank that owns it
    owned = (y >= r * v) & (y < (r + 1) * v)
    local_y = (y - r * v).masked_fill(~owned, 0)
    sum_exp = g(z.exp().sum(dim=-1), group)
    z_y = g(z.gather(1, local_y.unsqueeze(1)).squeeze(1) * owned, group)
    return (sum_exp.log() - z_y).mean()
