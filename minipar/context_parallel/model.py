"""The course GPT with context parallelism: every layer but attention on the local tokens.

Each cp rank holds T/c tokens of every sequence (:func:`shard_sequence`) and the whole model
(or its tensor-parallel share). Everything but attention is position-wise (embeddings, norms,
projections, MLPs, head) and runs on the local tokens at their global positions
(:func:`sequence_positions`). :func:`parallelize` swaps two kinds of modules, keeping their
parameters and names: each block's attention becomes :class:`ContextParallelAttention` (its
projections around ring, all-gather or Ulysses attention over the cp group), the embedding
:class:`PositionedEmbedding` (positions set per batch).

The global batch's loss is the mean over all B·T tokens; every rank holds as many, so
``L = 1/c Σ_r L_r`` with ``L_r`` the local mean. Each rank back-propagates ``L_r / c`` (times
1/dp with data parallelism), the attention backward carries the cross-rank terms, and every
replicated parameter's gradient is the **sum** over the ranks: one all-reduce over cp, or over
the combined dp × cp group (Megatron-LM).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from .attention import ContextParallelAttend


class ContextParallelAttention(nn.Module):
    """Self-attention whose ``attend`` is context-parallel; takes over ``attn``'s projections
    ``qkv`` and ``proj`` (a GPT block's, or a tensor-parallel block's: then this rank's heads)."""

    def __init__(self, attn: nn.Module, group=None, variant: str = "ring", layout: str = "zigzag"):
        super().__init__()
        self.qkv, self.proj = attn.qkv, attn.proj
        self.n_head, self.head_dim = attn.n_head, attn.head_dim   # heads on this rank
        self.attend = ContextParallelAttend(group, variant, layout)
        self.recompute = getattr(attn, "recompute", "none")      # "selective": see .attention
        self.attention = getattr(attn, "attention", "auto")      # each block fused or materialised

    def forward(self, x):
        B, T, _ = x.shape                      # T = this rank's tokens
        width = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = self.attend(q, k, v, selective=self.recompute == "selective", attention=self.attention)
        return self.proj(o.transpose(1, 2).reshape(B, T, width))


class PositionedEmbedding(nn.Module):
    """Token plus position embedding at the global positions ``self.positions`` of this
    rank's tokens; takes over ``embed``'s ``wte`` and ``wpe``."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.wte, self.wpe = embed.wte, embed.wpe
        self.positions = None

    def forward(self, idx):
        pos = self.positions
        if pos is None or pos.numel() != idx.shape[1]:
            raise RuntimeError("set the global positions of this rank's tokens first (set_positions)")
        return self.wte(idx) + F.embedding(pos.to(idx.device), self.wpe.weight)


def parallelize(model, group=None, variant: str = "ring", layout: str = "zigzag"):
    """Make the GPT ``model`` (or a tensor-parallel GPT) context-parallel over ``group``, in
    place: attention and embedding swapped, parameters and their names kept. Returns it."""
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, group, variant, layout)
    model.embed = PositionedEmbedding(model.embed)
    return model


def set_positions(model, positions: torch.Tensor) -> None:
    """The global positions of the tokens this rank feeds ``model`` next."""
    model.embed.positions = positions


def local_loss(model, idx, targets, positions):
    """Mean cross-entropy of this rank's tokens ``idx`` (B, T/c) at global ``positions``."""
    set_positions(model, positions)
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def all_reduce_grads(params, group=None, name: str = "cp_grads", dim: str = "cp") -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat all-reduce."""
    ps = [p for p in params if p.grad is not None]
    if not ps:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in ps])
    comm.all_reduce(flat, group=group, name=name, dim=dim)
    for p, g in zip(ps, flat.split([p.numel() for p in ps])):
        p.grad.copy_(g.view_as(p.grad))
