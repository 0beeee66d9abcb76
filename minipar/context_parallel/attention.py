"""One entry point for the three context-parallel attentions, and the hook into the GPT.

:func:`context_attention` dispatches to ring (:mod:`.ring`), all-gather (:mod:`.allgather`) or
Ulysses (:mod:`.ulysses`) attention; :class:`ContextParallelAttend` is what
:func:`~minipar.context_parallel.parallelize` puts in place of a GPT attention's ``attend(q, k, v)``.

Recomputation (:mod:`minipar.models.recompute`). ``"full"`` needs nothing here: the block is
checkpointed whole, so its backward first runs this attention's forward again, communication
included, in the same order on every rank. ``"selective"`` (``selective=True``) recomputes
the attention's local core, never its communication:

* ring: nothing changes. Ring attention keeps only Q, K, V, O and the lse, and its backward
  recomputes P = exp(S - lse) block by block (FlashAttention): the s² scores are never
  stored, so it saves the same bytes as ``"none"`` (measured in the tests).
* all-gather and Ulysses: :func:`~minipar.context_parallel.blockwise.masked_attention` on the
  gathered (or head-sharded) tensors is checkpointed: it keeps its inputs and drops the
  score-sized tensors and the boolean mask (the T² terms of
  :func:`minipar.cost.cp_activation_bytes`, exactly, measured in the tests).
"""
from __future__ import annotations

from .allgather import all_gather_attention
from .ring import ring_attention
from .ulysses import ulysses_attention

VARIANTS = ("ring", "all_gather", "ulysses")


def context_attention(q, k, v, group=None, causal: bool = True, layout: str = "contiguous",
                      variant: str = "ring", selective: bool = False, attention="auto"):
    """``(O, lse)`` of this rank's queries (B, H, T/c, d) against the whole sequence, by ``variant``;
    ``selective``: recompute the local attention core in backward (module docstring); ``attention``:
    the local blocks fused (``"sdpa"``) or written out (``"materialized"``), :mod:`.blocks`."""
    if variant == "ring":       # already FlashAttention-style: nothing s²-sized is kept
        return ring_attention(q, k, v, group, causal, layout, attention)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    attend = all_gather_attention if variant == "all_gather" else ulysses_attention
    return attend(q, k, v, group, causal, layout, selective=selective, attention=attention)


class ContextParallelAttend:
    """Callable ``attend(q, k, v, selective=False, attention="auto") -> O`` (causal) over the cp ``group``."""

    def __init__(self, group=None, variant: str = "ring", layout: str = "zigzag"):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.group, self.variant, self.layout = group, variant, layout

    def __call__(self, q, k, v, selective: bool = False, attention="auto"):
        if self.variant == "ulysses":   # its lse would cost one more all-to-all
            return ulysses_attention(q, k, v, self.group, True, self.layout, return_lse=False,
                                     selective=selective, attention=attention)[0]
        return context_attention(q, k, v, self.group, True, self.layout, self.variant, selective,
                                 attention)[0]
