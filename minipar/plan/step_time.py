"""Step time of one layout: compute, the pipeline bubble, and the exposed communication.

    T = T_compute + T_bubble + Σ_dim T_exposed(dim)

* **Compute.** The step's FLOPs (Narayanan et al. 2021: ``3·(forward)`` plus what recomputation
  adds, :mod:`minipar.cost.flops`) over N GPUs at a fraction ``efficiency`` of the peak:
  ``T_compute = FLOPs / (N · efficiency · peak)``, ``efficiency`` the one fitted parameter
  (kernels, memory-bound operations, launch gaps; :mod:`minipar.plan.calibrate`).
* **Bubble.** ``bubble_fraction(schedule, p, m, v) · T_compute`` (:mod:`minipar.cost.pipeline`).
* **Communication**, α-β on the link the group uses (:meth:`Cluster.link`), with these
  overlap assumptions:

  =====  ==========================================================  =========================
  dim    bytes per GPU and step                                       exposed
  =====  ==========================================================  =========================
  tp     m · l/p · :func:`~minipar.cost.tp_comm_bytes_per_layer`      all (Megatron-LM does not
         (×1.5 with full recomputation: its forward all-reduces)     overlap it)
  cp     3(cp-1) K, V blocks of ``2·(s/cp)·b·kv/tp`` per layer and    what exceeds the attention
         micro-batch (ring attention: forward, and twice backward)   compute it overlaps
  ep     4 all-to-alls of ``top_k·(s/cp)·b·h`` per MoE layer and      all
         micro-batch, (ep-1)/ep of it leaves the GPU
  pp     one activation each way per micro-batch and virtual stage   the pipeline's fill and
                                                                     drain, 2(p-1) messages
  dp     :func:`~minipar.cost.zero_comm_bytes` of the local Ψ         without pp: what exceeds
         (16-bit gradients)                                          the last micro-batch's
                                                                     backward; with pp or
                                                                     ``overlap_dp=False``: all
  =====  ==========================================================  =========================

A cluster's ``call_overhead`` (software seconds per collective or message: 0 for the catalogue's
GPU clusters, milliseconds on a CPU, fitted by :func:`minipar.plan.course.fit_call_overhead`) is
charged per call: per layer and micro-batch 4 all-reduces (10 gathers/scatters with SP) plus 4
for the embedding and the vocabulary-parallel loss, one per 25 MB bucket for DP, two (three for
ZeRO-3) per layer for ZeRO, two messages per micro-batch for PP. An accelerator's
``layer_overhead`` (seconds per layer pass beyond its FLOPs: 0 for the GPUs, measured on a CPU,
where dispatching small operations dominates) adds ``m · ⌈(l+2)/p⌉`` of it (embedding and head
count as layers). The optimizer step and data loading are left out.
"""
from __future__ import annotations

import math

from ..cost.pipeline import bubble_fraction
from ..cost.tensor_parallel import tp_comm_bytes_per_layer
from ..cost.zero import zero_comm_bytes
from .hardware import Cluster
from .memory import BUCKET
from .layout import Layout
from .models import ModelSpec


def step_flops(model: ModelSpec, layout: Layout, seq_len: int, global_batch: int) -> dict[str, float]:
    """``{"model", "hardware"}`` FLOPs of one step: model = 3 × forward (what MFU counts),
    hardware = model + recomputation."""
    tokens = global_batch * seq_len
    fwd = model.forward_flops_per_token(seq_len) * tokens
    extra = 0.0
    if layout.recompute == "full":
        extra = fwd - 2 * model.hidden * model.vocab * tokens   # every layer again, not the head
    elif layout.recompute == "selective":
        extra = model.attention_core_flops_per_token(seq_len) * tokens
    return {"model": 3 * fwd, "hardware": 3 * fwd + extra}


def _time(nbytes: float, messages: float, link: tuple[float, float], calls: float = 0.0,
          call_overhead: float = 0.0) -> float:
    alpha, beta = link
    return messages * alpha + nbytes * beta + calls * call_overhead


def comm_times(model: ModelSpec, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
               t_compute: float) -> dict[str, dict[str, float]]:
    """``{dim: {"bytes", "seconds", "exposed"}}`` per GPU and step (table in the docstring)."""
    L, e = layout, layout.bytes_per_element
    m, s = L.microbatches(global_batch), seq_len // L.cp
    layers = math.ceil(model.n_layer / L.pp)
    n, sbh = m * layers, s * L.micro_batch * model.hidden     # n: layer passes of one stage per step
    out, k = {}, cluster.call_overhead
    if L.tp > 1:
        f = 1.5 if L.recompute == "full" else 1   # full recomputation reruns the forward's all-reduces
        per = f * tp_comm_bytes_per_layer(L.micro_batch, s, model.hidden, L.tp, e, L.sp)
        steps = f * ((10 if L.sp else 8) * (L.tp - 1))  # ring steps: 10 gathers/scatters or 4 all-reduces
        calls = n * (10 if L.sp else 4) * f + 4 * m     # + embedding, loss
        sec = _time(n * per, n * steps, cluster.link(L.span("tp")), calls, k)
        out["tp"] = {"bytes": n * per, "seconds": sec, "exposed": sec, "calls": calls}
    if L.cp > 1:
        per = 3 * (L.cp - 1) * 2 * s * L.micro_batch * model.kv_dim / L.tp * e
        sec = _time(n * per, n * 3 * (L.cp - 1), cluster.link(L.span("cp")), n * 3 * (L.cp - 1), k)
        attn = t_compute * model.attention_core_flops_per_token(seq_len) / model.forward_flops_per_token(seq_len)
        out["cp"] = {"bytes": n * per, "seconds": sec, "exposed": max(0.0, sec - attn)}
    if L.ep > 1:
        per = 4 * (L.ep - 1) / L.ep * model.top_k * sbh * e / L.tp
        sec = _time(n * per, n * 4 * (L.ep - 1), cluster.link(L.span("ep")), 4 * n, k)
        out["ep"] = {"bytes": n * per, "seconds": sec, "exposed": sec}
    if L.pp > 1:
        msg, calls = e * sbh / (L.tp if L.sp else 1), 2 * m * L.v   # one activation each way
        link = cluster.link(L.span("pp"))
        sec = _time(calls * msg, calls, link, calls, k)
        out["pp"] = {"bytes": calls * msg, "seconds": sec, "calls": calls,   # software is never hidden
                     "exposed": _time(2 * (L.pp - 1) * msg, 2 * (L.pp - 1), link, calls, k)}
    n_dp = L.dp * L.cp
    if n_dp > 1:
        psi = model.num_params() / (L.tp * L.pp)
        nbytes = zero_comm_bytes(psi, n_dp, L.zero, dtype_bytes=e, padded=False)
        units = layers + (2 if L.pp == 1 else 1)      # ZeRO shards layer by layer (embedding, head too)
        calls = math.ceil(nbytes / 2 / BUCKET) if L.zero == 0 else (3 if L.zero == 3 else 2) * units
        messages = (3 if L.zero == 3 else 2) * (n_dp - 1) * max(1, layers)
        sec = _time(nbytes, messages, cluster.link(L.span("dp")), calls, k)
        hidden = 0.0 if L.pp > 1 or not L.overlap_dp else (2 / 3) * t_compute / m
        out["dp"] = {"bytes": nbytes, "seconds": sec, "exposed": max(0.0, sec - hidden), "calls": calls}
    return out


def step_time(model: ModelSpec, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
              efficiency: float = 0.5) -> dict:
    """``{"compute", "bubble", "comm": {dim: {...}}, "total", "flops": {...}}`` in seconds."""
    L = layout
    flops = step_flops(model, L, seq_len, global_batch)
    t_c = flops["hardware"] / (L.world * efficiency * cluster.gpu.peak_flops)
    t_c += cluster.gpu.layer_overhead * L.microbatches(global_batch) * math.ceil((model.n_layer + 2) / L.pp)
    bubble = bubble_fraction(L.schedule, L.pp, L.microbatches(global_batch), L.v) * t_c if L.pp > 1 else 0.0
    comm = comm_times(model, L, cluster, seq_len, global_batch, t_c)
    total = t_c + bubble + sum(c["exposed"] for c in comm.values())
    return {"compute": t_c, "bubble": bubble, "comm": comm, "total": total, "flops": flops}
