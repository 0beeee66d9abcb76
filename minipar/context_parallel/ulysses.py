"""Ulysses: all-to-all from sequence-sharded to head-sharded attention, and back.

DeepSpeed-Ulysses (Jacobs et al. 2023, "System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models"). Each rank holds Q, K, V (B, H, T/c, d): its tokens,
all heads. One all-to-all sends head group j (H/c heads) to rank j, which then holds **all T
tokens of H/c heads** and computes ordinary attention; a second all-to-all brings the output
back to sequence sharding. c must divide H; each all-to-all sends (c-1)/c of the rank's
tensor, with ``all_to_all_single`` (Gloo and NCCL; :func:`minipar.comm.all_to_all_single`).
"""
from __future__ import annotations

import torch
from .. import comm
from ..models.attention import resolve
from ..models.recompute import run
from .blockwise import masked_attention
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
    return torch.cat(all_to_all(parts, group, name).unbind(0), dim=-2)  # part j: rank j's tokens


def heads_to_seq(x: torch.Tensor, group=None, name: str = "ulysses_heads_to_seq") -> torch.Tensor:
    """(..., H/c, T, d) head-sharded -> (..., H, T/c, d) sequence-sharded: the inverse."""
    c = comm.group_size(group)
    parts = torch.stack(x.chunk(c, dim=-2))                              # (c, ..., H/c, T/c, d)
    return torch.cat(all_to_all(parts, group, name).unbind(0), dim=-3)  # part j: head group j


class Reshard(torch.autograd.Function):
    """``Reshard.apply(x, group, fn, inverse, grad_name)``: ``fn(x, group)`` (:func:`seq_to_heads` or
    :func:`heads_to_seq`); the backward sends the gradient through ``inverse``, named ``grad_name``."""

    @staticmethod
    def forward(ctx, x, group, fn, inverse, grad_name):
        ctx.group, ctx.inverse, ctx.grad_name = group, inverse, grad_name
        return fn(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.inverse(g.contiguous(), ctx.group, ctx.grad_name), None, None, None, None


def head_attention(q, k, v, pos, causal: bool = True, attention="auto"):
    """``(O, lse)`` of all T tokens of some heads, the tokens at global positions ``pos``. Fused,
    the tokens are put in sequence order first, so that the mask is the plain causal one the
    kernel skips blocks of (a zigzag order would need an explicit mask); materialised, ``pos``
    masks the scores directly."""
    if not causal or resolve(attention, q.device) != "sdpa":
        return masked_attention(q, k, v, pos, pos, causal, attention)
    order = torch.argsort(pos)
    back = torch.argsort(order)
    o, lse = masked_attention(*(t.index_select(-2, order) for t in (q, k, v)), causal=True, attention="sdpa")
    return o.index_select(-2, back), lse.index_select(-1, back)


def ulysses_attention(q, k, v, group=None, causal: bool = True, layout: str = "contiguous",
                      return_lse: bool = True, selective: bool = False, attention="auto"):
    """``(O, lse)`` of this rank's tokens (B, H, T/c, d), all heads, by head-sharded attention;
    ``lse`` costs one more all-to-all (``return_lse=False`` skips it: ``None``). ``selective``: the
    head-sharded attention keeps only its Q, K, V, recomputed in backward (not the all-to-alls)."""
    c = comm.group_size(group)
    check_heads(q.shape[-3], c)
    T = q.shape[-2] * c
    qkv = Reshard.apply(torch.stack([q, k, v]), group, seq_to_heads, heads_to_seq,
                        "ulysses_grad_heads_to_seq")                     # (3, B, H/c, T, d)
    pos = torch.cat([sequence_positions(T, i, c, layout, device=q.device) for i in range(c)])
    o, lse = run(head_attention, selective, qkv[0], qkv[1], qkv[2], pos, causal, attention)
    o = Reshard.apply(o, group, heads_to_seq, seq_to_heads, "ulysses_grad_seq_to_heads")
    lse = heads_to_seq(lse.detach().unsqueeze(-1), group, "ulysses_lse").squeeze(-1) if return_lse else None
    return o, lse
