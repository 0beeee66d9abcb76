"""One entry point for the three context-parallel attentions, and the hook into the GPT.

``context_attention(q, k, v, group, causal, layout, variant)`` dispatches to ring
(:mod:`.ring`), all-gather (:mod:`.allgather`) or Ulysses (:mod:`.ulysses`) attention; all
three take this rank's tokens (B, H, T/c, d) and return ``(O, lse)`` for them, equal to
full attention on the whole sequence restricted to these tokens.

:class:`ContextParallelAttend` is what :func:`~minipar.context_parallel.parallelize` puts in
place of a GPT attention module's ``attend(q, k, v)``: the rest of the block (the QKV and
output projections, layer norms, MLP) runs on the local tokens unchanged.
"""
from __future__ import annotations

from .allgather import all_gather_attention
from .ring import ring_attention
from .ulysses import ulysses_attention

VARIANTS = ("ring", "all_gather", "ulysses")


def context_attention(q, k, v, group=None, causal: bool = True, layout: str = "contiguous",
                      variant: str = "ring"):
    """``(O, lse)`` of this rank's queries against the whole sequence, by ``variant``."""
    if variant == "ring":
        return ring_attention(q, k, v, group, causal, layout)
    if variant == "all_gather":
        return all_gather_attention(q, k, v, group, causal, layout)
    if variant == "ulysses":
        return ulysses_attention(q, k, v, group, causal, layout)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


class ContextParallelAttend:
    """Callable ``attend(q, k, v) -> O`` (causal) over the cp ``group``."""

    def __init__(self, group=None, variant: str = "ring", layout: str = "zigzag"):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.group, self.variant, self.layout = group, variant, layout

    def __call__(self, q, k, v):
        if self.variant == "ulysses":
            return ulysses_attention(q, k, v, self.group, True, self.layout, return_lse=False)[0]
        return context_attention(q, k, v, self.group, True, self.layout, self.variant)[0]
