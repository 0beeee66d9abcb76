"""Activation memory with recomputation (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4-5, Table 2).

Bytes one transformer layer keeps for backward per rank (16-bit activations, s sequence
length, b micro-batch, h hidden, a heads, t tensor-parallel size):

    recompute      no parallelism           tensor parallel              tensor + sequence parallel
    none           sbh(34 + 5as/h)          sbh(10 + 24/t + 5as/(ht))    sbh(34/t + 5as/(ht))
    selective      34·sbh                   sbh(10 + 24/t)               34·sbh/t
    full           2·sbh                    2·sbh                        2·sbh/t

Selective recomputation drops the ``5as/h`` attention terms (softmax output, its dropout
mask and output: what grows with s²); full recomputation keeps only the layer's input
(2sbh, split by t under sequence parallelism, as Megatron-LM stores it). The "none" column
is :func:`minipar.cost.activation_bytes_per_layer`.
"""
from __future__ import annotations

from .flops import check_recompute
from .tensor_parallel import activation_terms

ATTENTION_TERMS = ("softmax output", "attention dropout mask and output")


def recompute_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none", *,
                               bytes_per_element: int = 2, dropout: bool = True) -> float:
    """Activation bytes per layer and rank under ``recompute`` (table above; ``bytes_per_element``
    and ``dropout`` as in :func:`minipar.cost.activation_terms`)."""
    check_recompute(recompute)
    if recompute == "full":
        return bytes_per_element * s * b * h / (t if sequence_parallel else 1)
    terms = activation_terms(s, b, h, a, t, sequence_parallel,
                             bytes_per_element=bytes_per_element, dropout=dropout)
    if recompute == "selective":
        terms = {k: v for k, v in terms.items() if k not in ATTENTION_TERMS}
    return sum(terms.values())
