"""Tensor and sequence parallelism: activation memory and communication per layer.

**Activation memory** (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Section 4, Equations 1-3): bytes one transformer layer keeps
for backward, with s the sequence length, b the micro-batch, h the hidden size, a the
number of heads, t the tensor-parallel size, 16-bit activations and 1-byte dropout masks:

    no parallelism                 sbh (34 + 5as/h)
    tensor parallel                sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel     sbh (34/t + 5as/(ht))

Term by term (Section 4.1), 16-bit, per layer: layer-norm inputs 4sbh, QKV input 2sbh,
Q and K 4sbh, V 2sbh, softmax output 2as²b, its dropout mask as²b and output 2as²b,
projection input 2sbh, attention dropout mask sbh, MLP input 2sbh, GeLU input 8sbh,
GeLU output 8sbh, MLP dropout mask sbh. Tensor parallelism divides the terms inside the
attention and MLP by t; the ``10sbh`` of layer norms, dropouts and the two matmul inputs
stay replicated until sequence parallelism splits them along s.

**Communication** (Shoeybi et al. 2019, Section 3): each layer does 2 all-reduces of the
(b, s, h) activation in forward (g after attention and after the MLP) and 2 in backward
(f before them). A ring all-reduce sends 2(t-1)/t of the message per rank, so per layer and
micro-batch each rank sends ``4 · 2(t-1)/t · bsh = 8bsh(t-1)/t`` elements. Sequence
parallelism replaces each all-reduce by an all-gather plus a reduce-scatter, the same
bytes, and (as in Megatron-LM) all-gathers the stored shard again in the backward of
each of the 2 column-parallel layers: ``2bsh(t-1)/t`` elements more.
"""
from __future__ import annotations

from .collectives import collective_bytes


def activation_terms(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                     *, bytes_per_element: int = 2, dropout: bool = True) -> dict[str, float]:
    """Activation bytes per layer and rank, by term (Korthikanti et al. 2022, Section 4.1).
    ``bytes_per_element``: 2 for the paper's 16-bit activations, 4 for fp32 (dropout masks
    stay 1 byte). ``dropout=False`` leaves out the masks and the attention-dropout output
    (a model without dropout does not store them)."""
    e, sbh, as2b = bytes_per_element, s * b * h, a * s * s * b
    rep = t if sequence_parallel else 1          # what divides the replicated terms
    terms = {
        "layer-norm inputs": 2 * e * sbh / rep,
        "QKV and MLP inputs": 2 * e * sbh / rep,
        "Q, K, V": 3 * e * sbh / t,
        "attention output (proj input)": e * sbh / t,
        "GeLU input and output": 8 * e * sbh / t,
        "softmax output": e * as2b / t,
    }
    if dropout:
        terms["dropout masks (attention, MLP)"] = 2 * sbh / rep
        terms["attention dropout mask and output"] = (1 + e) * as2b / t
    return terms


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                               sequence_parallel: bool = False, *, bytes_per_element: int = 2,
                               dropout: bool = True) -> float:
    """Bytes of activations one transformer layer stores per rank, Korthikanti et al. (2022):
    ``sbh(34 + 5as/h)``, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism,
    ``sbh(34/t + 5as/(ht))`` with sequence parallelism too (16-bit; see
    :func:`activation_terms` for other precisions and for no dropout)."""
    return sum(activation_terms(s, b, h, a, t, sequence_parallel,
                                bytes_per_element=bytes_per_element, dropout=dropout).values())


def tp_comm_bytes_per_layer(b: int, s: int, h: int, t: int, bytes_per_element: int = 2,
                            sequence_parallel: bool = False) -> float:
    """Bytes each rank sends per layer and micro-batch, forward and backward, ring
    collectives: ``8bsh(t-1)/t`` elements (4 all-reduces of bsh), plus ``2bsh(t-1)/t``
    with sequence parallelism (the backward re-gather of the 2 column-parallel inputs)."""
    msg = b * s * h * bytes_per_element
    regather = 2 * collective_bytes("all_gather", msg, t) if sequence_parallel else 0
    return 4 * collective_bytes("all_reduce", msg, t) + regather
