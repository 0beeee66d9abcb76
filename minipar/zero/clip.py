"""Gradient-norm clipping that is correct under every ZeRO stage (Pascanu et al. 2013).

Clipping rescales the averaged gradient ḡ when its global norm exceeds a bound c:

    ‖ḡ‖ = sqrt(Σ_u ‖ḡ_u‖²),     ḡ ← ḡ · min(1, c / (‖ḡ‖ + ε))      (ε = 1e-6, as PyTorch)

Under ZeRO no rank holds ḡ: rank r holds the disjoint shards ḡ_u[r·k : (r+1)·k] (zero
padding adds nothing to the sum). So each rank sums the squares of its own shards, one
all-reduce of that scalar gives ‖ḡ‖² on every rank, and every rank scales its shards by
the same factor: exactly what ``torch.nn.utils.clip_grad_norm_`` does on one device.
"""
from __future__ import annotations

import torch

from ..comm import all_reduce


def clip_grad_norm_(grad_shards, max_norm: float, group=None, eps: float = 1e-6) -> float:
    """Scale this rank's gradient shards in place so the *global* norm is at most
    ``max_norm``; returns the global norm before clipping (every rank the same)."""
    grads = [g for g in grad_shards if g is not None]
    if not grads:
        raise ValueError("no gradient shards to clip")
    sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum().reshape(1)
    all_reduce(sq, op="sum", group=group, name="grad_norm")
    norm = sq.sqrt()
    scale = (max_norm / (norm + eps)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm.item()
