"""Cross-entropy over vocabulary-parallel logits, without gathering them
(Shoeybi et al. 2019, Section 3: "fuse the output embedding GEMM with the cross-entropy
loss", which cuts the communication from b·s·V to b·s elements).

Rank r holds the logits ``z[:, v]`` of its vocabulary slice ``v ∈ [r·V/t, (r+1)·V/t)``.
The loss of each of the N = b·s positions is ``log Σ_v exp(z_v) - z_y``; the group combines
a few numbers per position instead of the logits, and the backward communicates nothing
(notebook 05, "The loss without the full logits").
"""
from __future__ import annotations

import torch

from .. import comm
from .ops import size_and_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # Contract:
    # Given: ``logits`` (..., V/t) are this rank's slice of the vocabulary (rank r holds tokens
    #     [r·V/t, (r+1)·V/t)), ``targets`` (...) the full targets on every rank; ``backward``
    #     receives the gradient of the returned mean loss.
    # ex05.C.exact: the loss and the gradient equal ``F.cross_entropy`` (mean) on the full logits,
    #     with targets on every rank's slice, whatever gradient the loss receives (a scaled loss too).
    # ex05.C.finite: finite and exact even when logits reach hundreds, and when one rank's logits
    #     are hundreds above another's.
    # ex05.C.bytes: the forward communicates a few numbers per position, never the logits.
    # ex05.C.backward: the backward, written by hand, communicates nothing.
    # ex05.C.fp32: the loss is computed in fp32, from bf16 logits too: within 1e-5 of
    #     ``F.cross_entropy`` on those bf16 values taken to fp32.
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
