"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Section 4.2.2).

Tensor parallelism leaves the layer norms, dropouts and residual adds replicated: every
rank holds the whole (b, s, h) activation there, the ``10·sbh`` term of Equation 2 that
does not shrink with t. They act on each token independently, so they can be split along
the **sequence** instead: rank r holds tokens ``[r·s/t, (r+1)·s/t)``, and the all-reduces
at the region boundaries become their two halves:

    g (enter a tensor-parallel region)   forward all-gather,     backward reduce-scatter
    ḡ (leave it)                         forward reduce-scatter, backward all-gather

Same bytes as the all-reduce (which *is* a reduce-scatter plus an all-gather), and every
activation is now divided by t: ``sbh(34/t + 5as/(ht))`` bytes per layer. Two details:

* The linear layer after g needs the gathered input in its backward (for dW). Storing it
  would undo the saving, so :func:`gather_linear` keeps only this rank's shard and
  all-gathers it again in backward (Section 4.2.3): one extra all-gather per
  column-parallel layer, which Megatron-LM overlaps with the gradient computation.
* Layer-norm weights, row-parallel biases and the position embedding are replicated but
  see only s/t tokens, so their gradients are partial sums: they enter through
  :func:`~minipar.tensor_parallel.ops.sync_grad` (f on a parameter), all-reduced in backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops import all_gather, gather_along, reduce_scatter, reduce_scatter_along, size_and_rank, split, sync_grad

SEQ_DIM = 1  # activations are (batch, sequence, hidden)


def gather_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's g: all-gather the sequence shards (reduce-scatter in backward)."""
    return all_gather(x, SEQ_DIM, group)


def reduce_scatter_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's ḡ: sum the partial outputs, keep this rank's sequence shard
    (all-gather in backward)."""
    return reduce_scatter(x, SEQ_DIM, group)


def split_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's sequence shard of a replicated tensor (all-gather in backward)."""
    return split(x, SEQ_DIM, group)


def check_seq_len(T: int, group=None) -> int:
    """The shard length ``T / t``, or a plain error when ``t`` does not divide ``T``."""
    t, _ = size_and_rank(group)
    if T % t:
        raise ValueError(f"sequence parallelism needs the sequence length T={T} to be "
                         f"divisible by the tensor-parallel size t={t}")
    return T // t


class _GatherLinear(torch.autograd.Function):
    """``Y = g(X_r) Aᵀ + b`` that saves only the shard ``X_r`` (re-gathered in backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_along(x, SEQ_DIM, group, "sp.all_gather"), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:   # under autocast grad is 16-bit, weight and x fp32: compute in grad's dtype
            grad_x = reduce_scatter_along(grad @ weight.to(grad.dtype), SEQ_DIM, ctx.group, "sp.reduce_scatter").to(x.dtype)
        if ctx.needs_input_grad[1]:
            total = gather_along(x, SEQ_DIM, ctx.group, "sp.all_gather (recompute)").to(grad.dtype)
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ total.reshape(-1, total.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias=None, group=None) -> torch.Tensor:
    """Column-parallel linear on a sequence shard: all-gather the sequence, then ``x Aᵀ + b``
    with this rank's output columns; only the shard is kept for backward."""
    return _GatherLinear.apply(x, weight, bias, group)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias=None, group=None) -> torch.Tensor:
    """Row-parallel linear whose partial sums are reduce-scattered along the sequence (ḡ);
    the replicated bias is added once, to the shard, its gradient summed by f."""
    y = reduce_scatter_seq(F.linear(x, weight), group)
    return y if bias is None else y + sync_grad(bias, group)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters) that can run on a sequence shard: with
    ``sequence_parallel=True`` the input is this rank's s/t tokens and the weight and bias
    pass through f, so their gradients are summed over the group."""

    def __init__(self, normalized_shape: int, group=None, sequence_parallel: bool = False,
                 eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if not self.sequence_parallel:
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, sync_grad(self.weight, self.group),
                            sync_grad(self.bias, self.group), self.eps)


class PositionEmbedding(nn.Embedding):
    """``nn.Embedding`` of positions (same parameter) that can run on a sequence shard: with
    ``sequence_parallel=True`` it is given all T positions and looks up this rank's T/t of
    them, the weight through f (its gradient is partial, as the layer norms')."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, pos):
        if not self.sequence_parallel:
            return super().forward(pos)
        Ts, r = check_seq_len(pos.shape[-1], self.group), size_and_rank(self.group)[1]
        return F.embedding(pos[..., r * Ts:(r + 1) * Ts], sync_grad(self.weight, self.group))


__all__ = ["gather_seq", "reduce_scatter_seq", "split_seq", "check_seq_len", "gather_linear",
           "linear_reduce_scatter", "LayerNorm", "PositionEmbedding"]
