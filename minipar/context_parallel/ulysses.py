"""Ulysses: all-to-all from sequence-sharded to head-sharded attention, and back.

DeepSpeed-Ulysses (Jacobs et al. 2023, "System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models"). Each rank holds Q, K, V (B, H, T/c, d) for its
tokens and all heads. One all-to-all sends head group j (H/c heads) to rank j: afterwards
each rank holds **all T tokens of H/c heads**, computes ordinary attention on them, and a
second all-to-all brings the output back to sequence sharding. Its degree is limited by the
heads: c must divide H. Each all-to-all sends (c-1)/c of the rank's tensor.

Gloo and NCCL both have ``all_to_all_single`` (one tensor cut in c equal parts along
dimension 0; :func:`minipar.comm.all_to_all_single`, recorded), which is all this module uses.
"""
from __future__ import annotations

import torch
from .. import comm
from ..models.recompute import run
from .blocks import masked_attention
from .sharding import sequence_positions


def all_to_all(x: torch.Tensor, group=None, name: str = "all_to_all") -> torch.Tensor:
    """Part i of ``x`` (cut along dim 0 into c parts) goes to rank i; part j of the result
    came from rank j. Recorded: each rank sends and receives (c-1)/c of ``x``'s bytes."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)   # contiguous, like x now
    comm.all_to_all_single(out, x, group=group, name=name, dim="cp")
    return out


def check_heads(n_head: int, cp: int, tp: int = 1) -> None:
    """Plain ``ValueError`` unless Ulysses can split ``n_head`` heads (``n_head/tp`` on each
    tensor-parallel rank) over ``cp`` ranks."""
    if n_head % (cp * tp):
        per = f" ({n_head // tp} per tp rank with tp={tp})" if tp > 1 else ""
        raise ValueError(f"Ulysses splits the heads over the cp ranks: n_head={n_head}{per} is not "
                         f"divisible by cp={cp} (use ring or all-gather attention, or cp | heads)")


def seq_to_heads(x: torch.Tensor, group=None, name: str = "ulysses_seq_to_heads") -> torch.Tensor:
    """(..., H, T/c, d) sequence-sharded -> (..., H/c, T, d) head-sharded (rank order of tokens)."""
    c = comm.group_size(group)
    *lead, H, Tl, d = x.shape
    parts = x.reshape(*lead, c, H // c, Tl, d).movedim(-4, 0)          # (c, ..., H/c, T/c, d)
    got = all_to_all(parts, group, name)                                 # part j: rank j's tokens
    return torch.cat(list(got.unbind(0)), dim=-2)


def heads_to_seq(x: torch.Tensor, group=None, name: str = "ulysses_heads_to_seq") -> torch.Tensor:
    """(..., H/c, T, d) head-sharded -> (..., H, T/c, d) sequence-sharded: the inverse."""
    c = comm.group_size(group)
    parts = torch.stack(x.chunk(c, dim=-2))                              # (c, ..., H/c, T/c, d)
    got = all_to_all(parts, group, name)                                 # part j: head group j
    return torch.cat(list(got.unbind(0)), dim=-3)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g.contiguous(), ctx.group, "ulysses_grad_heads_to_seq"), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g.contiguous(), ctx.group, "ulysses_grad_seq_to_heads"), None


def ulysses_attention(q, k, v, group=None, causal: bool = True, layout: str = "contiguous",
                      return_lse: bool = True, selective: bool = False):
    """``(O, lse)`` of this rank's tokens (B, H, T/c, d), all heads, by head-sharded attention.
    ``lse`` costs one more all-to-all (``return_lse=False`` skips it and returns ``None``).
    ``selective``: the head-sharded attention keeps only its Q, K, V and is recomputed in
    backward (the all-to-alls are not repeated)."""
    c = comm.group_size(group)
    check_heads(q.shape[-3], c)
    T = q.shape[-2] * c
    qkv = SeqToHeads.apply(torch.stack([q, k, v]), group)               # (3, B, H/c, T, d)
    pos = torch.cat([sequence_positions(T, i, c, layout, device=q.device) for i in range(c)])
    o, lse = run(masked_attention, selective, qkv[0], qkv[1], qkv[2], pos, pos, causal)
    o = HeadsToSeq.apply(o, group)
    if not return_lse:
        return o, None
    return o, heads_to_seq(lse.detach().unsqueeze(-1), group, "ulysses_lse").squeeze(-1)
