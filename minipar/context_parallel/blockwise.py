"""Attention on one block of keys, its backward, and the online-softmax merge.

For queries Q (B, H, Tq, d) and one block of keys and values K, V (B, H, Tk, d), with
scores S = Q Kᵀ / √d (masked entries -inf):

    lse = log Σ_k exp(S_qk)            (the log-sum-exp of each query's row)
    O   = exp(S - lse) V               (the softmax-weighted values)

Attention over keys split into blocks a and b is the **merge** of the two partial results
(Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1; ring attention,
Liu et al. 2023): one normaliser over both, exp(lse) = exp(lse_a) + exp(lse_b), and each O_x
renormalised to it, O = exp(lse_a - lse) · O_a + exp(lse_b - lse) · O_b. Computed as written,
that overflows fp32 once a log-sum-exp passes about 88 and loses precision near 1000;
:func:`merge_partials` is exact there too (its contract).

The backward of one block needs only the final O and lse (FlashAttention, Alg. 2):
P = exp(S - lse), D = rowsum(dO ∘ O), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D),
dQ = dS K / √d, dK = dSᵀ Q / √d.

Each function takes ``attention`` (:mod:`minipar.models.attention`): ``"materialized"`` computes
the equations above as written, S held whole; ``"sdpa"`` runs PyTorch's fused kernels, which return
the same O and lse (and take the same final O and lse in backward) without storing S; ``"auto"``
is the device's default. Ring, all-gather and Ulysses attention call only these.
"""
from __future__ import annotations

import math

import torch

from ..models.attention import fused_attention, fused_backward, fused_forward, resolve


def scores(q, k, causal: bool = False):
    """S = Q Kᵀ / √d, with the upper triangle masked when ``causal`` (equal-length blocks
    on the diagonal: query i sees keys 0..i)."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def attention_block(q, k, v, causal: bool = False, attention="materialized"):
    """``(O, lse)`` of queries ``q`` on one block of keys/values (no autograd needed)."""
    if resolve(attention, q.device) == "sdpa":
        return fused_forward(q, k, v, causal)
    return masked_attention(q, k, v, causal=causal)   # the diagonal block: query i sees keys 0..i


# Contract:
# Given: ``(o_x, lse_x)`` is attention of some queries over one block of keys: ``o`` (..., T, d)
#     the softmax-weighted values, ``lse`` (..., T) the log-sum-exp of each query's scores over
#     the block; ``(o_a, lse_a)`` and ``(o_b, lse_b)`` are over two disjoint blocks.
# ex08.A.exact: the result ``(o, lse)`` is attention of the same queries over both blocks
#     together, and merging the blocks of a split key set one at a time, in any order, gives
#     attention over the whole set (fp32, rtol = atol = 1e-5).
# ex08.A.unequal: the two blocks may hold different numbers of keys.
# ex08.A.stable: the result stays finite and as exact (rtol = atol = 1e-5) when the
#     log-sum-exps are near 1000, where ``exp`` of one overflows fp32, and where they differ by
#     hundreds.
# ex08.A.empty: where a query sees no key of one block (its ``lse`` is -inf), the merge gives
#     the other block's ``o`` and ``lse`` for that query, finite.
def merge_partials(o_a, lse_a, o_b, lse_b):
    """Online-softmax merge of two partial results over disjoint key blocks: ``(O, lse)`` of
    attention over both, exact in fp32 for log-sum-exps in the thousands too (never an ``exp``
    of a log-sum-exp itself). ``o_*``: (..., T, d); ``lse_*``: (..., T)."""
    # >>> ex08 A
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    lse = m + torch.log(w_a + w_b)
    o = (w_a.unsqueeze(-1) * o_a + w_b.unsqueeze(-1) * o_b) / (w_a + w_b).unsqueeze(-1)
    return o, lse
    # <<< ex08 A


def attention_block_backward(q, k, v, o, lse, do, causal: bool = False, delta=None,
                             attention="materialized"):
    """``(dQ, dK, dV)`` of one block, given the **final** ``o`` and ``lse`` of these queries
    (over all blocks) and the incoming gradient ``do``; ``delta`` = rowsum(dO ∘ O) if known
    (the fused kernel computes it itself)."""
    if resolve(attention, q.device) == "sdpa":
        return fused_backward(do, q, k, v, o, lse, causal)
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(scores(q, k, causal) - lse.unsqueeze(-1))
    delta = (do * o).sum(-1) if delta is None else delta
    dv = p.transpose(-2, -1) @ do
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def masked_attention(q, k, v, q_pos=None, k_pos=None, causal: bool = False, attention="materialized"):
    """``(O, lse)`` with query i seeing key j iff ``k_pos[j] <= q_pos[i]`` (when ``causal``), by
    autograd (O only, fused); full attention on the whole sequence is
    ``masked_attention(q, k, v, causal=True)``."""
    if resolve(attention, q.device) == "sdpa":
        if not causal or (q_pos is None and k_pos is None):
            return fused_attention(q, k, v, causal)
        q_pos = torch.arange(q.shape[-2], device=q.device) if q_pos is None else q_pos
        k_pos = torch.arange(k.shape[-2], device=k.device) if k_pos is None else k_pos
        return fused_attention(q, k, v, False, q_pos, k_pos)
    s = scores(q, k)
    if causal:
        q_pos = torch.arange(q.shape[-2], device=q.device) if q_pos is None else q_pos
        k_pos = torch.arange(k.shape[-2], device=k.device) if k_pos is None else k_pos
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse
