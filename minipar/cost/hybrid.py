"""Memory and communication per rank of 3D parallelism (data × pipeline × tensor).

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", §3) with ZeRO-1 over the data-parallel dimension (Rajbhandari et al.
2020, §5.1). With Ψ parameters on a ``dp × pp × tp`` mesh, a rank holds about Ψ/(p·t)
of them (its stage's layers, its tensor-parallel shard), so in fp32 with an optimizer of
K bytes per parameter (Adam: 8, SGD: 0)

    model states per rank = (4 + 4)·Ψ/(p·t) + K·Ψ/(p·t)        (K·Ψ/(p·t·d) with ZeRO-1)

and, per step, with global batch B, m micro-batches of b = B/(d·m) sequences of s tokens,
hidden size h, L transformer blocks and 4-byte elements, each rank sends

    dp   2(d-1)/d · 4Ψ/(p·t)                   gradient all-reduce (ZeRO-1: reduce-scatter
                                               + all-gather, the same bytes)
    tp   m · L/p · 4 all-reduces of b·s·h       per block: f and g, forward and backward
                                               (:func:`tp_comm_bytes_per_layer`)
    pp   2 · m · b·s·h · 4                     one activation forward and one gradient
                                               back per micro-batch (a middle stage;
                                               the first and last send half)

Ψ/(p·t) ignores what tensor parallelism replicates (layer norms, biases of row-parallel
layers, position embeddings) and the imbalance of the stages; the tp term ignores the
embedding and the vocabulary-parallel loss. The notebook shows how close that is.
"""
from __future__ import annotations

from .collectives import collective_bytes
from .tensor_parallel import tp_comm_bytes_per_layer


def _check(dp: int, pp: int, tp: int) -> None:
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def hybrid_memory_per_rank(num_params: float, dp: int, pp: int, tp: int, zero1: bool = False,
                           k: float = 8, dtype_bytes: int = 4) -> dict[str, float]:
    """Model-state bytes per rank ``{"params", "grads", "optimizer", "total"}``: Ψ/(p·t)
    parameters and gradients, the optimizer's K bytes per parameter divided by dp too
    under ZeRO-1. Defaults: fp32 Adam (4-byte values, K = 8)."""
    _check(dp, pp, tp)
    local = num_params / (pp * tp)
    params = grads = dtype_bytes * local
    optimizer = k * local / (dp if zero1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}


def hybrid_comm_bytes(num_params: float, n_layer: int, dp: int, pp: int, tp: int,
                      batch_size: int, seq_len: int, hidden: int, microbatches: int = 1,
                      dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step, by dimension ``{"dp", "tp", "pp", "total"}`` (ring
    collectives; ``batch_size`` is the global batch B; the pp term is a middle stage's)."""
    _check(dp, pp, tp)
    m, b = microbatches, batch_size / (dp * microbatches)
    act = b * seq_len * hidden * dtype_bytes
    out = {"dp": collective_bytes("all_reduce", dtype_bytes * num_params / (pp * tp), dp),
           "tp": m * n_layer / pp * tp_comm_bytes_per_layer(b, seq_len, hidden, tp, dtype_bytes),
           "pp": 2 * m * act if pp > 1 else 0.0}
    out["total"] = sum(out.values())
    return out
