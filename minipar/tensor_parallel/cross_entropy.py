"""Cross-entropy over vocabulary-parallel logits, without gathering them
(Shoeybi et al. 2019, Section 3: "fuse the output embedding GEMM with the cross-entropy
loss", which cuts the communication from b·s·V to b·s elements).

Rank r holds the logits ``z[:, v]`` of its vocabulary slice ``v ∈ [r·V/t, (r+1)·V/t)``.
For each of the N = b·s positions, with target y:

    loss = log Σ_v exp(z_v - m) - (z_y - m)          m = max_v z_v (for stability)

and every piece is a reduction over the vocabulary, so each rank reduces its slice and the
group combines N numbers per position instead of V/t:

    m          max over ranks of the local maxima       (all-gather of N maxima)
    Σ exp      sum over ranks of the local sums         (all-reduce, together with:)
    z_y        the one rank that owns y contributes it  (all-reduce of a masked value)

The gradient needs no communication at all: ``dL/dz_v = (softmax_v - [v = y]) / N`` for
this rank's v, from the local exponentials and the global sum saved in forward.
"""
from __future__ import annotations

import torch

from .. import comm
from .ops import size_and_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        # >>> ex05 C
        t, r = size_and_rank(group)
        z = logits.reshape(-1, logits.shape[-1]).float()
        y = targets.reshape(-1)
        n, v_local = z.shape
        start = r * v_local

        local_max = z.max(dim=-1).values.contiguous()
        maxima = torch.empty(t * n, dtype=z.dtype, device=z.device)
        comm.all_gather(maxima, local_max, group=group, name="ce.max")
        m = maxima.view(t, n).max(dim=0).values
        z = z - m.unsqueeze(1)

        owned = (y >= start) & (y < start + v_local)
        local_y = (y - start).masked_fill(~owned, 0)
        exp = z.exp()
        sums = torch.stack([exp.sum(-1), z.gather(1, local_y.unsqueeze(1)).squeeze(1) * owned])
        comm.all_reduce(sums, group=group, name="ce.all_reduce")
        sum_exp, z_y = sums

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), local_y, owned)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return (sum_exp.log() - z_y).mean()
        # <<< ex05 C

    @staticmethod
    def backward(ctx, grad):
        # >>> ex05 C
        softmax, local_y, owned = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_y] -= owned.to(g.dtype)
        g *= grad / g.shape[0]
        return g.view(ctx.shape).to(ctx.dtype), None, None
        # <<< ex05 C


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy of (..., V/t) vocabulary-parallel logits against (...) targets,
    equal to ``F.cross_entropy`` on the full logits; never gathers the logits."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
