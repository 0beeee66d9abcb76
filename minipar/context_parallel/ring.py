"""Ring attention: queries stay, key/value blocks travel around the context-parallel ring.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context". The queries stay on their rank; the key/value blocks travel around a ring of c
ranks, each transfer hidden behind the attention of the block in hand, and the partial results
merge exactly (online softmax, :func:`~minipar.context_parallel.blockwise.merge_partials`).
Under a causal mask a rank scores only the query-key pairs the mask keeps (:func:`ring_step`,
one of ``PARTS``); in the zigzag layout every off-diagonal step is the same work on every rank
(zigzag ring attention, Zhu 2024).

The backward (:class:`RingAttention`) is written out, from the final O and lse (FlashAttention's
backward): every rank's dQ, dK, dV equal full attention's gradients of its tokens. Each block's
step is fused or materialised (``attention``, :mod:`.blocks`); the ring is the same.
"""
from __future__ import annotations

import torch

from .. import comm
from ..runtime import trace
from .blockwise import attention_block, attention_block_backward, merge_partials

PARTS = ("full", "causal", "skip", "kv_front", "q_back")


# Contract:
# Given: one of ``PARTS`` says which query-key pairs of ``rank``'s queries and ``src``'s block
#     a ring step scores, as ``_views`` cuts them out: "full" every pair, unmasked; "causal" every
#     pair under the causal mask (two blocks of the same positions); "kv_front" every query with
#     the block's first half of keys, unmasked; "q_back" the second half of the queries with
#     every key, unmasked; "skip" none. Blocks are laid out by ``layout`` ("contiguous":
#     rank r holds the r-th of cp blocks; "zigzag": the chunks ``zigzag_chunks(r, cp)``).
# ex08.C.parts: the part ``ring_step`` returns scores exactly the pairs the mask keeps (every
#     pair without ``causal``), none twice and none that the mask hides.
# ex08.C.skip: a block wholly in the future of a rank's queries is skipped, never computed.
def ring_step(rank: int, src: int, cp: int, causal: bool = True, layout: str = "contiguous") -> str:
    """What ``rank``'s queries compute with the key/value block of ``src`` (one of ``PARTS``)."""
    # >>> ex08 C
    if not causal:
        return "full"
    if src == rank:
        return "causal"
    if layout == "contiguous":
        return "full" if src < rank else "skip"
    return "kv_front" if src < rank else "q_back"
    # <<< ex08 C


def schedule(cp: int, causal: bool = True, layout: str = "contiguous") -> list[list[tuple[int, str]]]:
    """``[rank][step] -> (src, part)``: which block every rank holds at every step, and what it does."""
    return [[((r - s) % cp, ring_step(r, (r - s) % cp, cp, causal, layout)) for s in range(cp)]
            for r in range(cp)]


def _views(q, kv, part):
    """The queries, keys, values a part uses, and the query rows it writes."""
    k, v = kv[0], kv[1]
    if part == "kv_front":
        h = k.shape[-2] // 2
        return q, k[..., :h, :], v[..., :h, :], slice(None), slice(0, h)
    if part == "q_back":
        h = q.shape[-2] // 2
        return q[..., h:, :], k, v, slice(h, None), slice(None)
    return q, k, v, slice(None), slice(None)


def _start_exchange(buf_out, prv, nxt, group, name, tag):
    """Start sending ``buf_out`` to ``nxt`` and receiving its like from ``prv``; returns ``wait()``,
    which waits for both and returns the received buffer."""
    buf_in = torch.empty_like(buf_out)
    # one exchange (under NCCL one batch of both: separate posts deadlock a ring of 3+ ranks)
    pending = comm.start_exchange(buf_out, nxt, buf_in, prv, group, name=name, tag=tag, dim="cp")

    def wait():
        pending.wait()
        return buf_in
    return wait


# Contract:
# Given: q, k, v (B, H, T/c, d) are this rank's tokens on the cp ``group`` (c ranks).
#     ``_start_exchange(buf, prv, nxt, group, name, tag)`` starts sending ``buf`` to group rank
#     ``nxt`` and receiving one like it from ``prv``, and returns ``wait()``, which returns what
#     arrived; ``ring_step``, ``_views``, ``attention_block`` and ``merge_partials`` are yours
#     to use.
# ex08.C.exact: on every rank the returned ``(O, lse)`` equal full attention's rows of that
#     rank's tokens (fp32, rtol = atol = 1e-5), contiguous or zigzag, causal or not, on 2 and 4
#     ranks.
# ex08.C.sends: each rank sends c-1 K, V blocks per forward (``name="ring_kv"``, tag 0), each to
#     the next rank of the ring: the forward bytes of ``cost.cp_comm_bytes("ring", ...)``.
# ex08.*.group: on a non-world group (a cp group of 2 out of 4 ranks), ranks count within their
#     group and only its ranks take part.
# ex08.*.dtype: each dtype kept (float64 and bfloat16 in, the same dtype out).
# ex08.*.recorded: every transfer goes through ``minipar.comm`` (``_start_exchange`` does), so the
#     trace records its bytes.
def ring_forward(q, k, v, group=None, causal: bool = True, layout: str = "contiguous", attention="auto"):
    """``(O, lse)`` of this rank's queries over the whole sequence's keys (no autograd)."""
    # >>> ex08 C
    # Hint: _start_exchange, ring_step, _views, attention_block and merge_partials are given.
    c, r = comm.group_size(group), comm.group_rank(group)
    nxt, prv = (r + 1) % c, (r - 1) % c
    kv, o, lse = torch.stack([k, v]), None, None
    for s in range(c):
        src = (r - s) % c
        if s < c - 1:   # send the block in hand on, receive the next one, while computing
            nxt_kv = _start_exchange(kv, prv, nxt, group, "ring_kv", 0)
        part = ring_step(r, src, c, causal, layout)
        with trace.region("attention", step=s, src=src, part=part, dim="cp"):
            if part != "skip":
                qs, ks, vs, rows, _ = _views(q, kv, part)
                o_b, lse_b = attention_block(qs, ks, vs, part == "causal", attention)
                if o is None:   # step 0 is the diagonal: every query has at least itself
                    o, lse = o_b, lse_b
                else:           # merged into the rows this part computed (no autograd here)
                    o[..., rows, :], lse[..., rows] = merge_partials(o[..., rows, :], lse[..., rows],
                                                                     o_b, lse_b)
        kv = nxt_kv() if s < c - 1 else kv
    return o, lse
    # <<< ex08 C


# Contract:
# Given: ``o`` and ``lse`` are the forward's final result for this rank's queries, ``do`` the
#     gradient of ``o``; ``attention_block_backward(q, k, v, o, lse, do, causal, delta,
#     attention)`` gives one block's ``(dQ, dK, dV)`` from the final ``o`` and ``lse``.
# ex08.D.exact: ``(dQ, dK, dV)`` equal full attention's gradients of the rank's tokens (fp32,
#     rtol = atol = 1e-5) on 2 and 4 ranks, on a non-world group and with a skipped block.
# ex08.D.sends: per backward each rank sends c-1 K, V blocks (tag 0) and c gradient buffers of
#     the same size (``name="ring_dkv"``, tag 1): the backward bytes of
#     ``cost.cp_comm_bytes("ring", ...)``.
# ex08.D.second: a second step after the first (another q, k, v and dO) is as exact as the
#     first.
def ring_backward(q, k, v, o, lse, do, group=None, causal: bool = True, layout: str = "contiguous",
                  attention="auto"):
    """``(dQ, dK, dV)`` of this rank's tokens, from the forward's final ``o`` and ``lse`` (no autograd)."""
    # >>> ex08 D
    # Hint: attention_block_backward takes the final o and lse; use tag 1 for the dK, dV exchange.
    c, r = comm.group_size(group), comm.group_rank(group)
    nxt, prv = (r + 1) % c, (r - 1) % c
    delta = (do * o).sum(-1)
    kv, dq, pending = torch.stack([k, v]), torch.zeros_like(q), None
    for s in range(c):
        src = (r - s) % c
        if s < c - 1:
            nxt_kv = _start_exchange(kv, prv, nxt, group, "ring_kv", 0)
        part = ring_step(r, src, c, causal, layout)
        contrib = torch.zeros_like(kv)
        with trace.region("attention_backward", step=s, src=src, part=part, dim="cp"):
            if part != "skip":
                qs, ks, vs, rows, cols = _views(q, kv, part)
                dq_b, dk_b, dv_b = attention_block_backward(
                    qs, ks, vs, o[..., rows, :], lse[..., rows], do[..., rows, :],
                    causal=part == "causal", delta=delta[..., rows], attention=attention)
                dq[..., rows, :] += dq_b
                contrib[0][..., cols, :] += dk_b
                contrib[1][..., cols, :] += dv_b
        if pending is not None:     # the accumulator of block src, from rank r-1
            contrib += pending()
        if c > 1:                   # (alone, the block is mine already)
            pending = _start_exchange(contrib, prv, nxt, group, "ring_dkv", 1)
        kv = nxt_kv() if s < c - 1 else kv
    dkv = pending() if c > 1 else contrib   # my own block's gradient, from every rank's queries
    return dq, dkv[0], dkv[1]
    # <<< ex08 D


class RingAttention(torch.autograd.Function):
    """``O, lse = RingAttention.apply(q, k, v, group, causal, layout, attention)``; q, k, v
    (B, H, T/c, d) are this rank's tokens, ``lse`` is not differentiated."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, attention="auto"):
        o, lse = ring_forward(q, k, v, group, causal, layout, attention)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.attention = group, causal, layout, attention
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, o, lse, do.contiguous(), ctx.group, ctx.causal, ctx.layout,
                                   ctx.attention)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, group=None, causal: bool = True, layout: str = "contiguous", attention="auto"):
    """``(O, lse)`` of this rank's queries (B, H, T/c, d) against the whole sequence; each block's step
    fused or materialised (``attention``)."""
    return RingAttention.apply(q, k, v, group, causal, layout, attention)
