"""ZeRO memory and communication per rank (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, §5 and Figure 1).

With Ψ parameters, N data-parallel ranks and mixed-precision Adam (fp16/bf16 parameters
and gradients, 2 bytes each; fp32 master copy, momentum and variance, K = 12 bytes per
parameter), the model states per rank are

    stage 0  (plain data parallelism)   2Ψ + 2Ψ + KΨ
    stage 1  P_os      shard optimizer  2Ψ + 2Ψ + KΨ/N
    stage 2  P_os+g    + gradients      2Ψ + (2 + K)Ψ/N
    stage 3  P_os+g+p  + parameters     (2 + 2 + K)Ψ/N

In fp32 (no master copy) the parameters and gradients take 4 bytes each and Adam's two
moments K = 8: ``dtype_bytes=4, k=8``; SGD with momentum has K = 4, plain SGD K = 0.

Padding. minipar shards each unit (a layer) separately, zero-padding its Ψ_u elements to a
multiple of N; ``num_params`` may be that list of unit sizes. With ``padded=True`` every
flattened quantity uses Ψ̂ = Σ_u N·⌈Ψ_u/N⌉ (a shard is Ψ̂/N elements), what minipar allocates;
stage 0 is not flattened and uses Ψ. ``padded=False`` gives the paper's formulas with real-valued Ψ/N.

Communication per rank and step (§7): stages 0-2 move 2Ψ (all-reduce, or reduce-scatter
of gradients + all-gather of parameters), stage 3 moves 3Ψ (all-gather for the forward,
again for the backward, reduce-scatter of gradients); times (N-1)/N for the ring.

Stage 3 under a pipeline of m micro-batches (:func:`zero3_pipeline_comm_bytes`,
:func:`zero3_pipeline_peak_bytes`; Ψ is then one pipeline stage's parameters). Resharding
after every use gathers each unit 2m times and reduce-scatters m times, (2m + m)(N-1)/N·Ψ;
keeping the units gathered across the micro-batches (``reshard_after_forward=False``)
gathers once and reduce-scatters once, 2(N-1)/N·Ψ, ZeRO-1's traffic. The price is memory
during the step: the stage's gathered parameters and its whole accumulated gradients,

    kept gathered  peak = (4 + K)Ψ̂/N + 4Ψ̂ + 4Ψ     (fp32; the gradient shards exist only after
                                                   the step's reduce-scatter)

i.e. ZeRO-1's 4Ψ + 4Ψ + KΨ/N plus the 4Ψ/N of parameter shards kept beside their gathered
copies: *above* ZeRO-1, not between ZeRO-1 and resharding. Resharding holds stage 3's states
with the gradient shards the earlier micro-batches reduced into, two gathered units (prefetch)
and the whole gradients of the unit being reduced:

    resharding     peak = (4 + 4 + K)Ψ̂/N + 4(Ψ̂_i + Ψ̂_i-1) + 4Ψ_i     (the largest such i)

With l units of Ψ/l each the extra over stage 3 is 12Ψ/l, below ZeRO-1 only when
12/l < 8(1 - 1/N), l > 1.5·N/(N-1) (more than 3 units for N = 2): the order by peak is then
ZeRO-3 resharding < ZeRO-1 < ZeRO-3 kept gathered. The course's 4-layer GPT on two stages has 3
units a stage (two of them layers), and there resharding peaks above ZeRO-1 too.
:func:`zero3_pipeline_peak_bytes` gives both; ``hybrid.run`` measures them (``peak_state_bytes``).

HSDP (:func:`hsdp_comm_bytes`): stage 3 within blocks of S = dp_shard ranks, replicated over
R = dp_replicate blocks: memory that of stage 3 with N = S, bytes 3(S-1)/S·Ψ in the block and
2(R-1)/R·Ψ/S across blocks.

Persistent parameters (stage 3; DeepSpeed's ``stage3_param_persistence_threshold``):
``persistent=Ψ_p`` elements kept whole on every rank, outside ``num_params``, cost
(2 + 2 + K)Ψ_p per rank (replicated, no 1/N) and one all-reduce of their gradients,
2(N-1)/N·Ψ_p, instead of the gathers.
"""
from __future__ import annotations

from collections.abc import Sequence

from .collectives import collective_bytes

STAGES = (0, 1, 2, 3)


def _sizes(num_params, dp: int, stage: int, padded: bool) -> tuple[float, float]:
    """(replicated element count, shard element count) for this stage's layout."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp (the number of data-parallel ranks) must be a positive int, got {dp!r}")
    units = list(num_params) if isinstance(num_params, Sequence) else [num_params]
    if any(u < 0 for u in units):
        raise ValueError("parameter counts must be >= 0")
    psi = sum(units)
    if stage == 0 or not padded:
        return psi, psi / dp
    k = sum(-(-u // dp) for u in units)
    return k * dp, k


def zero_bytes_per_rank(num_params, dp: int, stage: int, k: float = 12, dtype_bytes: int = 2,
                        padded: bool = True, persistent: float = 0) -> dict[str, float]:
    """Bytes of model states per rank: ``{"params", "grads", "optimizer", "total"}``.
    ``num_params``: Ψ, or the list of unit sizes Ψ_u; ``dp``: N; ``stage``: 0-3; ``k``: optimizer
    bytes per parameter (12 mixed-precision Adam, 8 fp32 Adam); ``dtype_bytes``: bytes per
    parameter and per gradient (2 for fp16/bf16, 4 for fp32); ``persistent``: Ψ_p elements
    stage 3 keeps whole (not in ``num_params``)."""
    full, shard = _sizes(num_params, dp, stage, padded)
    if persistent and stage != 3:
        raise ValueError("persistent parameters are a stage-3 option")
    params = dtype_bytes * ((shard if stage >= 3 else full) + persistent)
    grads = dtype_bytes * ((shard if stage >= 2 else full) + persistent)
    optimizer = k * ((shard if stage >= 1 else full) + persistent)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}


def zero_comm_bytes(num_params, dp: int, stage: int, dtype_bytes: int = 4,
                    padded: bool = True, persistent: float = 0) -> float:
    """Bytes each rank sends per step (ring algorithms): stage 0 all-reduces the gradients
    (2(N-1)/N·Ψ); stages 1-2 reduce-scatter gradients and all-gather parameters (same
    total); stage 3 all-gathers the parameters twice and reduce-scatters once (3(N-1)/N·Ψ),
    and all-reduces the ``persistent`` elements' gradients (2(N-1)/N·Ψ_p)."""
    full, _ = _sizes(num_params, dp, stage, padded)
    if persistent and stage != 3:
        raise ValueError("persistent parameters are a stage-3 option")
    nbytes = full * dtype_bytes
    if stage == 0:
        return collective_bytes("all_reduce", nbytes, dp)
    gathers = 2 if stage == 3 else 1
    return (gathers * collective_bytes("all_gather", nbytes, dp)
            + collective_bytes("reduce_scatter", nbytes, dp)
            + (collective_bytes("all_reduce", persistent * dtype_bytes, dp) if persistent else 0.0))


def zero3_pipeline_comm_bytes(num_params, dp: int, microbatches: int, reshard_after_forward: bool,
                              dtype_bytes: int = 4, padded: bool = True) -> float:
    """Bytes each rank sends per step for one pipeline stage's ``num_params`` (Ψ or its unit
    sizes) under ZeRO-3 with ``microbatches`` micro-batches: resharding, 2m all-gathers and m
    reduce-scatters; kept gathered, one of each (module docstring)."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    full, _ = _sizes(num_params, dp, 3, padded)
    nbytes, m = full * dtype_bytes, microbatches if reshard_after_forward else 1
    gathers = 2 * m if reshard_after_forward else 1
    return (gathers * collective_bytes("all_gather", nbytes, dp)
            + m * collective_bytes("reduce_scatter", nbytes, dp))


def zero3_pipeline_peak_bytes(units: Sequence, dp: int, reshard_after_forward: bool, k: float = 8,
                              dtype_bytes: int = 4, prefetch: bool = True) -> dict[str, float]:
    """Model-state bytes per rank at the peak of a step of ZeRO-3 over one pipeline stage whose
    units (layers) have ``units`` elements, m > 1 micro-batches (module docstring): ``{"shards"``
    (parameter shards and optimizer state), ``"grad_shards"`` (the reduced gradient shards:
    resharding reduces every micro-batch into them; kept gathered makes them after the peak),
    ``"gathered"`` (gathered units alive at once: every unit kept gathered, or unit i and, with
    ``prefetch``, the one before it), ``"grads"`` (whole gradients: every unit's, or unit i's
    while it is reduced), ``"total"}``; resharding's i is the unit where the sum peaks."""
    units = list(units)
    padded = [dp * -(-u // dp) for u in units]
    shards = (dtype_bytes + k) * sum(padded) / dp
    if reshard_after_forward:   # at unit i's reduce-scatter: i and the unit before it gathered, i's gradients
        at = [(padded[i] + (padded[i - 1] if prefetch and i else 0), units[i]) for i in range(len(units))]
        gathered, grads = max(at, key=lambda a: a[0] + a[1])
        grad_shards = dtype_bytes * sum(padded) / dp
    else:
        gathered, grads, grad_shards = sum(padded), sum(units), 0.0
    out = {"shards": shards, "grad_shards": grad_shards, "gathered": dtype_bytes * gathered,
           "grads": dtype_bytes * grads}
    out["total"] = sum(out.values())
    return out


def hsdp_comm_bytes(num_params, dp_shard: int, dp_replicate: int, dtype_bytes: int = 4,
                    padded: bool = True) -> dict[str, float]:
    """Bytes each rank sends per step under HSDP (Zhao et al. 2023, §3.2.3): stage 3 within the
    ``dp_shard`` block, 3(S-1)/S·Ψ, then one all-reduce of its Ψ/S gradient shard across the
    ``dp_replicate`` blocks, 2(R-1)/R·Ψ/S: ``{"dp_shard", "dp_replicate"}``."""
    full, shard = _sizes(num_params, dp_shard, 3, padded)
    return {"dp_shard": zero_comm_bytes(num_params, dp_shard, 3, dtype_bytes, padded),
            "dp_replicate": collective_bytes("all_reduce", shard * dtype_bytes, dp_replicate)}
