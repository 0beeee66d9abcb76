"""Context parallelism: bytes, activation memory and attention FLOPs per rank.

B sequences of T tokens over c context-parallel ranks (T/c tokens each), hidden size h,
a heads of d = h/a, b bytes per element. Per rank and per transformer layer:

**Bytes sent** (what :mod:`minipar.context_parallel` records; Liu et al. 2023; Dubey et al.
2024 §3.3.2; Jacobs et al. 2023 §3):

    ring        forward  (c-1) · 2·B·(T/c)·h·b        K and V passed on c-1 times
                backward (c-1) · 2·B·(T/c)·h·b        K, V around again
                       +   c   · 2·B·(T/c)·h·b        dK, dV around and home
    all-gather  forward  (c-1)/c · 2·B·T·h·b          all-gather of K, V (ring algorithm)
                backward (c-1)/c · 2·B·T·h·b          reduce-scatter of dK, dV
    Ulysses     forward  (c-1)/c · 4·B·(T/c)·h·b      all-to-all of Q, K, V, and of O back
                backward (c-1)/c · 4·B·(T/c)·h·b      the same, transposed

Ring and all-gather send the same in the forward, ≈ 2·B·T·h·b whatever c; Ulysses sends
≈ 4·B·T·h·b/c, falling as 1/c, but needs c | a.

**Activation memory** saved for the backward by one block of minipar's GPT (fp32, no
dropout), per rank: every variant keeps the position-wise part, ∝ B·(T/c); all-gather and
Ulysses also keep score matrices that grow with T² (ring attention keeps only O and lse):

    ring        B·(T/c)·(17h + a + 4)·b
    all-gather  B·(T/c)·(14h + a + 4)·b + 2·B·T·h·b + 2·B·a·(T/c)·T·b + (T/c)·T
    Ulysses     B·(T/c)·(16h + a + 4)·b + 2·B·(a/c)·T²·b + T²

(the last terms: the gathered K, V; two score-sized tensors; the boolean causal mask).
With recomputation (:mod:`minipar.models.recompute`; measured exactly by the tests):

    full        B·(T/c)·h·b     any variant: the block's input only (Korthikanti's 2sbh at b bytes, s = T/c)
    selective   ring        as without: ring attention keeps no scores to drop (its backward
                            already recomputes P from Q, K and lse)
                all-gather  B·(T/c)·(14h + 4)·b + 2·B·T·h·b + 8·(T/c + T)
                Ulysses     B·(T/c)·(16h + 4)·b + 8·T

Selective checkpoints the masked attention core: it keeps its inputs Q, K, V and the int64
positions, and drops the scores, the mask and the lse; the communication is not repeated.

**Attention FLOPs** (forward; 4·d per query-key pair and head, QKᵀ and PV; the backward is
2.5 times that: five matmuls instead of two). Rank r of the ring computes, in blocks of
B·a·(T/c)²·4d FLOPs: contiguous causal r + 1 blocks (the diagonal computed whole, later
blocks skipped), zigzag causal 1 + (c-1)/2 on every rank, no mask c.
"""
from __future__ import annotations

VARIANTS = ("ring", "all_gather", "ulysses")


def cp_comm_bytes(variant: str, batch: int, seq_len: int, hidden: int, cp: int,
                  bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes one rank sends per layer: ``{"forward", "backward", "total"}`` (module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    c, local = cp, batch * (seq_len // cp) * hidden * bytes_per_element   # one tensor of this rank's tokens
    if c == 1:
        return {"forward": 0, "backward": 0, "total": 0}
    if variant == "ring":
        fwd, bwd = (c - 1) * 2 * local, (c - 1) * 2 * local + c * 2 * local
    elif variant == "all_gather":
        fwd = bwd = (c - 1) * 2 * local
    else:
        fwd = bwd = (c - 1) * 4 * local // c
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def cp_activation_bytes(variant: str, batch: int, seq_len: int, hidden: int, n_head: int,
                        cp: int, bytes_per_element: int = 4, recompute: str = "none") -> int:
    """Bytes one rank saves for the backward in one GPT block under ``recompute`` (module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    B, T, h, a, c, b = batch, seq_len, hidden, n_head, cp, bytes_per_element
    tokens = B * (T // c)
    if recompute == "full":
        return tokens * h * b
    if recompute == "selective" and variant == "all_gather":
        return tokens * (14 * h + 4) * b + 2 * B * T * h * b + 8 * (T // c + T)
    if recompute == "selective" and variant == "ulysses":
        return tokens * (16 * h + 4) * b + 8 * T
    if variant == "ring":
        return tokens * (17 * h + a + 4) * b
    if variant == "all_gather":
        return tokens * (14 * h + a + 4) * b + 2 * B * T * h * b + 2 * B * a * (T // c) * T * b + (T // c) * T
    return tokens * (16 * h + a + 4) * b + 2 * B * (a // c) * T * T * b + T * T


def attention_blocks_per_rank(cp: int, layout: str = "contiguous", causal: bool = True) -> list[float]:
    """Blocks of (T/c)² query-key pairs each rank of the ring computes (module docstring)."""
    if not causal:
        return [float(cp)] * cp
    if layout == "zigzag":
        return [1 + (cp - 1) / 2] * cp
    return [float(r + 1) for r in range(cp)]


def attention_flops_per_rank(batch: int, seq_len: int, n_head: int, head_dim: int, cp: int,
                             layout: str = "contiguous", causal: bool = True,
                             backward: bool = False) -> list[float]:
    """Forward (or backward, ×2.5) attention FLOPs of each rank of the ring, in rank order."""
    block = 4 * batch * n_head * (seq_len // cp) ** 2 * head_dim
    return [n * block * (2.5 if backward else 1) for n in attention_blocks_per_rank(cp, layout, causal)]


def cp_imbalance(cp: int, layout: str = "contiguous") -> float:
    """Busiest rank's causal attention work over the mean: the time the others wait (1 = balanced)."""
    work = attention_blocks_per_rank(cp, layout, True)
    return max(work) / (sum(work) / len(work))
