"""Communication per dimension, and how much of it the schedule hides behind compute.

α-β on the link the group uses (:meth:`Cluster.link`); each dimension overlaps what its
schedule lets it overlap, the compute windows timed by the roofline (:mod:`.roofline`),
and pays the rest ("exposed"):

=====  ==============================================  =============================================
dim    bytes per GPU and step                          overlapped with / exposed
=====  ==============================================  =============================================
tp     m·l/p · :func:`~minipar.cost.tp_comm_bytes_      nothing by default: Megatron-LM's all-reduces
       per_layer` (×1.5 with full recomputation)       (or SP's gathers and scatters) sit between the
                                                       GEMMs that need them (Shoeybi et al. 2019, §3).
                                                       ``overlap_tp`` (with SP): each gather or scatter
                                                       is cut into t chunks pipelined with the GEMM
                                                       that consumes or produces it (Wang et al. 2022,
                                                       "Overlap Communication with Dependent
                                                       Computation via Decomposition", ASPLOS '23;
                                                       Megatron-Core's ``--tp-comm-overlap``, PyTorch's
                                                       async TP): forward the gathers behind QKV and
                                                       MLP-up, the scatters behind attention-out and
                                                       MLP-down; backward the re-gather behind ∂X and
                                                       the scatter of ∂X behind ∂W of the column-
                                                       parallel GEMMs, the gather of ∂Y behind ∂X of
                                                       the row-parallel ones (:data:`TP_WINDOWS_FWD`,
                                                       :data:`TP_WINDOWS_BWD`); each pays
                                                       ``max(0, c - t_GEMM) + c/t``, its first or last
                                                       chunk having nothing to hide behind
cp     per layer pass (cp-1) K,V blocks forward,        ring attention (Liu et al. 2023, §3.1): step
       2(cp-1) backward (K,V and dK,dV), each           i's transfer runs behind block i's attention,
       ``2·(s/cp)·b·kv/tp`` elements                    so each step pays ``max(0, t_send - t_block)``;
                                                       t_block = the layer's attention (roofline) / cp
ep     4 all-to-alls of ``top_k·(s/cp)·b·h`` per MoE    nothing (dispatch and combine wait for them)
       layer and micro-batch, (ep-1)/ep leaves the GPU
pp     one activation each way per micro-batch and      steady-state sends run behind the other
       virtual stage                                   micro-batches; the fill and drain's 2(p-1)
                                                       messages are exposed
dp     :func:`~minipar.cost.zero_comm_bytes` of the     ZeRO 0-2: gradients reduced in 25 MB buckets
       local Ψ (16-bit gradients; ZeRO-3 ×m)           as the last micro-batch's backward produces
                                                       them (PyTorch DDP, Li et al. 2020, §3.2.3):
                                                       bucket i is ready after (i+1)/k of the
                                                       backward, the link is serial, the tail after
                                                       the backward is exposed; ZeRO-1/2's parameter
                                                       all-gather after the step is exposed. ZeRO-3:
                                                       layer i+1's gather prefetched behind layer i's
                                                       forward, gather + reduce-scatter behind its
                                                       backward (FSDP), for every micro-batch: per
                                                       layer ``max(0, c - t)``, plus the first gather.
       kept gathered (``Layout.kept_gathered``, the    ZeRO-3 kept gathered: each unit's one gather
       default with pp > 1): ZeRO-1's 2(N-1)/N·Ψ,      behind the first micro-batch's forward, its one
       one gather and one reduce-scatter per unit      reduce-scatter behind the last one's backward,
       (:func:`~minipar.cost.zero3_pipeline_comm_   per layer ``max(0, c - t)`` each, plus the
       bytes`), not 3m(N-1)/N·Ψ                        first gather. ``overlap_dp=False``: all exposed
                                                       (Megatron-LM 2021 with pp > 1)
dp_    HSDP (``Layout.dp_shard`` = S): the dp row's    dp_shard: as dp; dp_replicate: the one
shard  ZeRO-3 over S·cp ranks (their link), and one    all-reduce runs after the step's last reduce-
dp_re  all-reduce of the eΨ/(S·cp) gradient shard      scatter, exposed (:func:`minipar.cost.         
plica  across the R = dp/S blocks (the dp group's      hsdp_comm_bytes`): only Ψ/N of a rank's bytes
te     link: between nodes when dp spans them)         cross the slow link, where plain ZeRO-3 sends
                                                       3(N-1)/N·Ψ per micro-batch over it
=====  ==============================================  =============================================

**Hidden is not free.** An overlapped transfer still reads its bytes from HBM and writes what it
receives there while the compute it hides behind runs (and NCCL's kernels take SMs): each
hidden byte charges ``2/HBM bandwidth`` seconds (Pati et al. 2024, "T3: Transparent Tracking &
Triggering for Fine-grained Overlap of Compute & Collectives", §2.3: overlapped collectives
slow the GEMMs they overlap by contending for memory bandwidth). So two layouts tie only
when they do the same work.

A cluster's ``call_overhead`` (software seconds per round of a collective: 0 for the catalogue's
GPU clusters, milliseconds on a loaded CPU, where each of a ring's rounds waits for a peer the
scheduler may have set aside) is charged per round and never hidden: a ring all-reduce over k
ranks has 2(k-1) rounds, a gather, scatter or all-to-all k-1, a message one. Calls per step:
per layer and micro-batch 4 all-reduces (10 gathers/scatters with SP) plus 4 for the embedding
and the loss, one per bucket for DP, two (three for ZeRO-3, per micro-batch) per layer for ZeRO,
two messages per micro-batch for PP.
"""
from __future__ import annotations

import math

from ..cost.tensor_parallel import tp_comm_bytes_per_layer
from ..cost.collectives import collective_bytes
from ..cost.zero import zero3_pipeline_comm_bytes, zero_comm_bytes
from .layout import Layout
from .memory import BUCKET
from .models import ModelSpec


# the GEMM each of sequence parallelism's gathers and scatters runs behind, per layer (module docstring)
TP_WINDOWS_FWD = ("QKV", "attention out", "MLP up", "MLP down")
TP_WINDOWS_BWD = ("QKV dX", "QKV dW", "MLP up dX", "MLP up dW", "attention out dX", "MLP down dX")


def _time(nbytes: float, messages: float, link: tuple[float, float], calls: float = 0.0,
          call_overhead: float = 0.0) -> float:
    alpha, beta = link
    return messages * alpha + nbytes * beta + calls * call_overhead


def bucketed(total: float, buckets: int, window: float) -> float:
    """Exposed seconds of ``buckets`` equal transfers (``total`` seconds in all) on one serial link,
    bucket i ready at ``(i+1)/buckets`` of a ``window`` of compute: the time past the window."""
    t, c = 0.0, total / buckets
    for i in range(buckets):
        t = max(t, window * (i + 1) / buckets) + c
    return max(0.0, t - window)


def comm_times(model: ModelSpec, layout: Layout, cluster, seq_len: int, global_batch: int,
               compute: dict) -> dict[str, dict[str, float]]:
    """``{dim: {"bytes", "seconds", "exposed", "link", ...}}`` per GPU and step (table above);
    ``compute`` the per-pass seconds of :func:`minipar.plan.step_time.compute_times`."""
    L, e, k = layout, layout.bytes_per_element, cluster.call_overhead
    m, s = L.microbatches(global_batch), seq_len // L.cp
    layers = math.ceil(model.n_layer / L.pp)
    n, sbh = m * layers, s * L.micro_batch * model.hidden     # n: layer passes of one stage per step
    rc = 1 if L.recompute == "full" else 0
    out = {}

    def link_name(dim):
        return cluster.gpu.link if L.span(dim) <= cluster.gpus_per_node else cluster.network

    if L.tp > 1:
        f = 1.5 if rc else 1   # full recomputation reruns the forward's all-reduces
        per = f * tp_comm_bytes_per_layer(L.micro_batch, s, model.hidden, L.tp, e, L.sp)
        steps = f * ((10 if L.sp else 8) * (L.tp - 1))  # ring steps: 10 gathers/scatters or 4 all-reduces
        calls = n * (10 if L.sp else 4) * f + 4 * m     # + embedding, loss
        rounds = calls * (L.tp - 1) * (1 if L.sp else 2)   # a ring all-reduce: 2(t-1) rounds, gather/scatter t-1
        sec = _time(n * per, n * steps, cluster.link(L.span("tp")), rounds, k)
        exposed = sec
        if L.tp_overlap_on(cluster.gpu):
            c = _time((L.tp - 1) / L.tp * e * sbh, L.tp - 1, cluster.link(L.span("tp")))   # one gather or scatter
            windows = [compute["ops"][g] for g in TP_WINDOWS_FWD] * (1 + rc) + \
                [compute["ops"][g] for g in TP_WINDOWS_BWD]
            exposed = n * sum(max(0.0, c - g) + c / L.tp for g in windows) + rounds * k
        out["tp"] = {"bytes": n * per, "seconds": sec, "exposed": exposed, "calls": calls}
    if L.cp > 1:
        msg = 2 * s * L.micro_batch * model.kv_dim / L.tp * e
        link = cluster.link(L.span("cp"))
        send = _time(msg, 1, link, 1, k)
        fwd_block, bwd_block = compute["attention_fwd"] / L.cp, compute["attention_bwd"] / L.cp
        per_pass = (1 + rc) * (L.cp - 1) * max(0.0, send - fwd_block) + (L.cp - 1) * max(0.0, 2 * send - bwd_block)
        msgs = (3 + rc) * (L.cp - 1)
        out["cp"] = {"bytes": n * msgs * msg, "seconds": n * msgs * send, "exposed": n * per_pass,
                     "calls": n * msgs}
    if L.ep > 1:
        per = 4 * (L.ep - 1) / L.ep * model.top_k * sbh * e / L.tp
        sec = _time(n * per, n * 4 * (L.ep - 1), cluster.link(L.span("ep")), 4 * n * (L.ep - 1), k)
        out["ep"] = {"bytes": n * per, "seconds": sec, "exposed": sec, "calls": 4 * n}
    if L.pp > 1:
        msg, calls = e * sbh / (L.tp if L.sp else 1), 2 * m * L.v   # one activation each way
        link = cluster.link(L.span("pp"))
        sec = _time(calls * msg, calls, link, calls, k)
        out["pp"] = {"bytes": calls * msg, "seconds": sec, "calls": calls,   # software is never hidden
                     "exposed": _time(2 * (L.pp - 1) * msg, 2 * (L.pp - 1), link, calls, k)}
    n_dp = L.zero_ranks
    if n_dp > 1:
        out["dp_shard" if L.hsdp else "dp"] = _dp(model, L, cluster, n_dp, layers, compute,
                                                  "dp_shard" if L.hsdp else "dp")
    if L.hsdp:
        out["dp_replicate"] = _replicate(model, L, cluster)
    for dim, c in out.items():
        c["link"] = link_name(dim)
        hidden = c["bytes"] * (1 - min(1.0, c["exposed"] / c["seconds"])) if c["seconds"] else 0.0
        c["contention"] = 2 * hidden / cluster.gpu.hbm_bw
        c["exposed"] += c["contention"]
    return out


def _dp(model, L, cluster, n_dp, layers, compute, dim="dp") -> dict:
    e, k = L.bytes_per_element, cluster.call_overhead
    link = cluster.link(L.span(dim))
    psi = model.num_params() / (L.tp * L.pp)
    kept, mb = L.kept_gathered, L.microbatches(compute["global_batch"])
    if kept:                                      # one gather and one reduce-scatter per unit and step
        nbytes = zero3_pipeline_comm_bytes(psi, n_dp, mb, False, dtype_bytes=e, padded=False)
    else:
        nbytes = zero_comm_bytes(psi, n_dp, L.zero, dtype_bytes=e, padded=False)
    if L.zero == 3 and not kept:                  # FSDP gathers and scatters again for every micro-batch
        nbytes *= mb
    units = layers + (2 if L.pp == 1 else 1)      # ZeRO shards layer by layer (embedding, head too)
    messages = (3 if L.zero == 3 and not kept else 2) * (n_dp - 1) * max(1, layers)
    if L.zero == 0:
        calls = math.ceil(nbytes / 2 / BUCKET)
    else:
        calls = (3 * mb if L.zero == 3 and not kept else 2) * units
    rounds = calls * (n_dp - 1) * (2 if L.zero == 0 else 1)   # all-reduce 2(N-1) rounds, gather/scatter N-1
    sec = _time(nbytes, messages, link, rounds, k)
    software = rounds * k
    wire = sec - software
    if not L.overlap_dp:
        exposed = sec
    elif kept:                                     # per layer: the gather (first forward), the scatter (last backward)
        c = wire / (2 * units)
        exposed = c + units * (max(0.0, c - compute["layer_fwd"]) + max(0.0, c - compute["layer_bwd"])) + software
    elif L.zero == 3:                              # per layer: gather (forward), gather + scatter (backward)
        mb = L.microbatches(compute["global_batch"])
        c_f, c_b = wire / (3 * units * mb), 2 * wire / (3 * units * mb)
        exposed = mb * (c_f + units * (max(0.0, c_f - compute["layer_fwd"]) + max(0.0, c_b - compute["layer_bwd"])))
        exposed += software
    else:
        grads = wire if L.zero == 0 else wire / 2   # ZeRO-1/2: the reduce-scatter half overlaps
        buckets = max(1, math.ceil(psi * e / BUCKET))
        exposed = bucketed(grads, buckets, compute["stage_bwd"]) + (wire - grads) + software
    return {"bytes": nbytes, "seconds": sec, "exposed": exposed, "calls": calls}


def _replicate(model, L, cluster) -> dict:
    """HSDP's all-reduce of the gradient shards across the dp_replicate blocks, after the step."""
    shard = L.bytes_per_element * model.num_params() / (L.tp * L.pp) / L.zero_ranks
    R, link = L.dp_replicate, cluster.link(L.span("dp_replicate"))
    nbytes = collective_bytes("all_reduce", shard, R)
    sec = _time(nbytes, 2 * (R - 1), link, 2 * (R - 1), cluster.call_overhead)
    return {"bytes": nbytes, "seconds": sec, "exposed": sec, "calls": 1}
