"""FLOPs of training a GPT-style transformer, and what recomputation adds.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", §5.1, Appendix): a layer's forward on a batch of B sequences of s
tokens, hidden size h, costs ``24Bsh² + 4Bs²h`` FLOPs (the four h×h-shaped matmuls of
attention and the two h×4h of the MLP, ``2·12h²`` per token, plus ``QKᵀ`` and ``attn·V``,
``2·2s·h`` per token); the output layer ``2BshV``. Backward costs twice the forward, and
full recomputation one more forward of every layer, so with l layers and vocabulary V

    no recomputation      72·B·s·l·h² · (1 + s/(6h) + V/(12·l·h))
    full recomputation    96·B·s·l·h² · (1 + s/(6h) + V/(16·l·h))      (the paper's formula)
    selective             72·B·s·l·h² · (1 + s/(6h) + V/(12·l·h)) + 4·B·s²·h·l

Selective recomputation (Korthikanti et al. 2022, §5) recomputes only ``QKᵀ``, softmax,
dropout and ``attn·V``: one more ``4Bs²h`` per layer (softmax and dropout are memory-bound
and not counted as FLOPs, which is why the measured overhead, 7% on 22B, exceeds this count).
"Model FLOPs" (for MFU, Chowdhery et al. 2022, Appendix B) are those without recomputation.

What PyTorch's non-reentrant checkpoint executes is a little less: it stops recomputing as
soon as it has rebuilt the last tensor the backward needs, so the final matmul of the
recomputed region never runs again — the MLP's output projection (``8Bsh²``) under full
recomputation, ``attn·V`` (``2Bs²h``) under selective (:func:`checkpoint_recompute_flops`).
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def check_recompute(recompute: str) -> None:
    """A plain ``ValueError`` for a recomputation mode not in :data:`RECOMPUTE`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def layer_forward_flops(B: float, s: float, h: float) -> float:
    """One transformer layer's forward: ``24Bsh² + 4Bs²h``."""
    return 24 * B * s * h * h + 4 * B * s * s * h


def recompute_flops(B: float, s: float, h: float, l: int, recompute: str = "full") -> float:
    """FLOPs recomputation adds per step: l layer forwards (full), l·4Bs²h (selective), 0."""
    check_recompute(recompute)
    if recompute == "full":
        return l * layer_forward_flops(B, s, h)
    return l * 4 * B * s * s * h if recompute == "selective" else 0.0


def training_flops(B: float, s: float, l: int, h: float, V: float, recompute: str = "full") -> float:
    """FLOPs of one training step (forward, backward, and recomputation) on B sequences:
    ``96Bslh²(1 + s/6h + V/16lh)`` with full recomputation (Narayanan et al. 2021)."""
    model = 3 * (l * layer_forward_flops(B, s, h) + 2 * B * s * h * V)
    return model + recompute_flops(B, s, h, l, recompute)


def narayanan_flops(B: float, s: float, l: int, h: float, V: float) -> float:
    """The paper's closed form, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``."""
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def checkpoint_recompute_flops(B: float, s: float, h: float, l: int, recompute: str = "full") -> float:
    """FLOPs the checkpointed recomputation actually runs (early stop, see above):
    ``l·(16Bsh² + 4Bs²h)`` full, ``l·2Bs²h`` selective."""
    check_recompute(recompute)
    if recompute == "full":
        return l * (16 * B * s * h * h + 4 * B * s * s * h)
    return l * 2 * B * s * s * h if recompute == "selective" else 0.0
