"""A tensor-parallel transformer block (Shoeybi et al. 2019, Section 3, Figure 3).

* **MLP**: ``fc`` column-parallel (h -> 4h/t per rank), GeLU on the local slice, ``proj``
  row-parallel (4h/t -> h, summed by g). One all-reduce in forward, one in backward.
* **Self-attention**: heads are independent, so rank r takes heads ``[r·a/t, (r+1)·a/t)``:
  the fused, column-parallel ``qkv`` outputs ``[q_r, k_r, v_r]``, its heads' slices of q, k
  and v (:mod:`minipar.tensor_parallel.gpt` puts the weight rows there), attention runs on
  the local heads with no communication (fused or materialised, ``GPTConfig.attention``,
  :mod:`minipar.models.attention`), and ``proj`` is row-parallel.
* Layer norms and residual adds are replicated (plain tensor parallelism) or act on this
  rank's sequence shard (``sequence_parallel=True``, Korthikanti et al. 2022).

The arithmetic is that of :mod:`minipar.models.gpt`, so the block reproduces the
single-device one. Dropout is not supported (it needs a random state shared by the group,
Megatron-LM's RNG tracker); :func:`~minipar.tensor_parallel.check` says so.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.attention import causal_attention, check_attention, resolve
from ..models.gpt import GPTConfig
from ..models.recompute import check_mode, run
from .layers import ColumnParallelLinear, RowParallelLinear
from .ops import divide, size_and_rank
from .sequence import LayerNorm


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split over ``group``."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.n_head = divide(c.n_head, size_and_rank(group)[0], "n_head")   # heads on this rank
        self.head_dim = c.n_embd // c.n_head
        self.local_embd = self.n_head * self.head_dim
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        self.qkv = ColumnParallelLinear(c.n_embd, 3 * c.n_embd, **kw)
        self.proj = RowParallelLinear(c.n_embd, c.n_embd, **kw)
        self.recompute = check_mode(getattr(c, "recompute", "none"))
        self.attention = check_attention(getattr(c, "attention", "auto"))

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.local_embd, dim=2)   # (B, T, h/t) each; T is the full length
        B, T, _ = q.shape
        q, k, v = (u.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for u in (q, k, v))
        selective = self.recompute == "selective" and resolve(self.attention, q.device) != "sdpa"
        y = run(self._attend, selective, q, k, v)   # selective: keeps q, k, v only (fused: the kernel's own)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.local_embd))

    def _attend(self, q, k, v):
        if resolve(self.attention, q.device) == "sdpa":   # the fused kernel
            return causal_attention(q, k, v, "sdpa")
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


class ParallelMLP(nn.Module):
    """``proj(GeLU(fc(x)))`` with fc column-parallel and proj row-parallel."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        self.fc = ColumnParallelLinear(c.n_embd, 4 * c.n_embd, **kw)
        self.proj = RowParallelLinear(4 * c.n_embd, c.n_embd, **kw)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; x is (B, T, h), or (B, T/t, h) with
    sequence parallelism."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        self.ln1, self.attn = LayerNorm(c.n_embd, **kw), ParallelAttention(c, **kw)
        self.ln2, self.mlp = LayerNorm(c.n_embd, **kw), ParallelMLP(c, **kw)
        self.recompute = check_mode(getattr(c, "recompute", "none"))

    def forward(self, x):
        """With full recomputation only ``x`` is kept (and its collectives run again in backward)."""
        return run(self._forward, self.recompute == "full", x)

    def _forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
