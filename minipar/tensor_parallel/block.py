"""A tensor-parallel transformer block (Shoeybi et al. 2019, Section 3, Figure 3).

The block *is* the GPT's :class:`~minipar.models.gpt.Block`, ``x + attn(ln1(x))`` then
``x + mlp(ln2(x))`` with its recomputation, built with parallel layers in place of the
single-device ones; the forward code is the GPT's, not a copy:

* **MLP**: ``fc`` column-parallel (h -> 4h/t per rank), GeLU on the local slice, ``proj``
  row-parallel (4h/t -> h, summed by g). One all-reduce in forward, one in backward.
* **Self-attention**: heads are independent, so rank r takes heads ``[r·a/t, (r+1)·a/t)``:
  the fused, column-parallel ``qkv`` outputs ``[q_r, k_r, v_r]``, its heads' slices of q, k
  and v (:mod:`minipar.tensor_parallel.gpt` puts the weight rows there), attention runs on
  the local heads with no communication (fused or materialised, ``GPTConfig.attention``,
  :mod:`minipar.models.attention`), and ``proj`` is row-parallel.
* Layer norms and residual adds are replicated (plain tensor parallelism) or act on this
  rank's sequence shard (``sequence_parallel=True``, Korthikanti et al. 2022: the layer norms
  are :class:`~minipar.tensor_parallel.sequence.LayerNorm`).

Dropout is not supported (it needs a random state shared by the group, Megatron-LM's RNG
tracker); :func:`~minipar.tensor_parallel.check` says so, and the block's dropouts (p = 0)
are the identity.
"""
from __future__ import annotations

from functools import partial

from ..models.gpt import Block, CausalSelfAttention, FeedForward, GPTConfig
from .layers import ColumnParallelLinear, RowParallelLinear
from .ops import divide, size_and_rank
from .sequence import LayerNorm


class ParallelAttention(CausalSelfAttention):
    """The GPT's causal self-attention on this rank's ``n_head/t`` heads: ``qkv`` column-parallel,
    ``proj`` row-parallel over ``group``."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        heads = divide(c.n_head, size_and_rank(group)[0], "n_head")   # heads on this rank
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        super().__init__(c, qkv=ColumnParallelLinear(c.n_embd, 3 * c.n_embd, **kw),
                         proj=RowParallelLinear(c.n_embd, c.n_embd, **kw), n_head=heads)


class ParallelMLP(FeedForward):
    """The GPT's ``proj(GeLU(fc(x)))`` with ``fc`` column-parallel and ``proj`` row-parallel."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        super().__init__(c, fc=ColumnParallelLinear(c.n_embd, 4 * c.n_embd, **kw),
                         proj=RowParallelLinear(4 * c.n_embd, c.n_embd, **kw))


class ParallelBlock(Block):
    """The GPT's block with :class:`ParallelAttention`, :class:`ParallelMLP` and (sequence
    parallelism) layer norms on the sequence shard; x is (B, T, h), or (B, T/t, h) with
    sequence parallelism. With full recomputation only ``x`` is kept and the block's
    collectives run again in backward."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        super().__init__(c, attn=ParallelAttention(c, **kw), mlp=ParallelMLP(c, **kw),
                         norm=partial(LayerNorm, **kw))
