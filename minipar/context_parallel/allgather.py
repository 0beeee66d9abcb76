"""All-gather attention (Llama 3's context parallelism, Dubey et al. 2024 §3.3.2).

Every rank all-gathers the whole sequence's keys and values (K and V stacked, one all-gather)
and computes its own queries' attention on them, masked by global positions: simpler than the
ring and easy to combine with any mask, but it holds all T keys and values at once (the ring
two blocks). The all-gather's backward is a reduce-scatter of dK, dV: every rank gets the sum
of all ranks' gradients for its own tokens.
"""
from __future__ import annotations

import torch

from .. import comm
from ..models.recompute import run
from .blockwise import masked_attention
from .sharding import sequence_positions


class GatherSequence(torch.autograd.Function):
    """(…, T/c, d) per rank -> (…, T, d) in rank order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        c = comm.group_size(group)
        ctx.group, ctx.shape = group, x.shape
        out = torch.empty(c * x.numel(), device=x.device, dtype=x.dtype)
        comm.all_gather(out, x.contiguous().reshape(-1), group=group, name="cp_all_gather_kv", dim="cp")
        return torch.cat(out.view(c, *x.shape).unbind(0), dim=-2)   # (c, ..., T/c, d) -> (..., T, d)

    @staticmethod
    def backward(ctx, g):
        c = comm.group_size(ctx.group)
        flat = torch.cat([p.reshape(-1) for p in g.chunk(c, dim=-2)])
        out = torch.empty(flat.numel() // c, device=g.device, dtype=g.dtype)
        comm.reduce_scatter(out, flat, group=ctx.group, name="cp_reduce_scatter_dkv", dim="cp")
        return out.view(ctx.shape), None


def all_gather_attention(q, k, v, group=None, causal: bool = True, layout: str = "contiguous",
                         selective: bool = False, attention="auto"):
    """``(O, lse)`` of this rank's queries (B, H, T/c, d) on all-gathered keys and values. ``selective``:
    the masked attention keeps only q and the gathered K, V, recomputed in backward (not the all-gather).
    ``attention``: the masked attention written out or fused (with the positions' mask as a bias)."""
    c, r = comm.group_size(group), comm.group_rank(group)
    T = q.shape[-2] * c
    kv = GatherSequence.apply(torch.stack([k, v]), group)      # (2, B, H, T, d), rank order
    q_pos = sequence_positions(T, r, c, layout, device=q.device)
    k_pos = torch.cat([sequence_positions(T, i, c, layout, device=q.device) for i in range(c)])
    return run(masked_attention, selective, q, kv[0], kv[1], q_pos, k_pos, causal, attention)
