"""Step time of one layout: compute from the roofline, the pipeline bubble, the exposed communication.

    T = T_compute + T_bubble + Σ_dim T_exposed(dim)

* **Compute** (:mod:`.roofline`): every operation of a layer, its backward, what recomputation
  reruns (full: the layer's forward; selective: the attention core when it is materialized,
  nothing under flash attention, which stores no scores), and the embedding, head and loss,
  each at the rate its shape allows on the accelerator. A pipeline runs at the pace of its busiest
  stage: ``m · max_r (l_r · layer + ends_r)``, with ``l_r`` the layers of stage r
  (:func:`minipar.plan.memory.stage_layers`: Llama 3's cut when p does not divide l), the
  embedding on the first stage and the head and loss on the last; plus the optimizer step over the
  elements this GPU updates (its ZeRO shard). A CPU's ``layer_overhead`` (seconds of op dispatch
  per layer pass, measured) adds ``m · ⌈(l+2)/p⌉`` of it.
* **Bubble.** ``bubble_fraction(schedule, p, m, v)`` of the micro-batches' compute (:mod:`minipar.cost.pipeline`);
  none where the ranks outnumber the CPU cores they share (``cluster.cores``): a rank waiting in
  the bubble yields its core to the others, whose rates were measured with every rank busy. That
  holds on a quiet machine; where other work keeps ``cluster.background`` threads runnable (the
  load average before the ranks started), a yielded core goes to them in proportion, and the
  bubble is charged ``min(1, background/cores)`` of its length (:func:`charged`).
* **Communication** and its overlap: :mod:`.overlap`.

FLOPs (:func:`step_flops`) are counted as Narayanan et al. 2021 count them, for TFLOP/s and MFU;
the roofline decides the time they take.
"""
from __future__ import annotations

import math

from ..cost.pipeline import bubble_fraction
from . import roofline
from .hardware import Cluster
from .layout import Layout
from .memory import stage_layers
from .models import ModelSpec
from .overlap import comm_times as _comm_times


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


def compute_times(model: ModelSpec, layout: Layout, accelerator, seq_len: int, global_batch: int,
                  efficiency=None) -> dict:
    """Seconds of one GPU's compute: per layer pass (``layer_fwd``, ``layer_bwd``, ``layer_rc``,
    ``attention_fwd``/``_bwd``), the busiest stage's backward of one micro-batch (``stage_bwd``), the
    step's micro-batches (``microbatches``), ``optimizer``, ``total``, ``bound`` (seconds by what
    bounds them: compute or memory), and ``ops``: each forward and backward operation of a layer
    pass, by name (the windows communication hides behind, :mod:`.overlap`)."""
    L, acc = layout, accelerator
    attn = L.attention_on(acc)
    ops = roofline.layer_ops(model, L, seq_len, attn)
    core = roofline.attention_ops(model, L, seq_len, attn)
    bwd = roofline.backward(ops)
    rc = ops if L.recompute == "full" else core if (L.recompute == "selective" and attn == "materialized") else []
    t = lambda o: roofline.ops_time(o, acc, efficiency)           # noqa: E731
    each = [roofline.op_time(op, acc, efficiency) for op in ops + bwd]   # timed once: summed, and the windows
    f, b, r = sum(each[:len(ops)]), sum(each[len(ops):]), t(rc)
    embedding, head = roofline.embedding_ops(model, L, seq_len), roofline.head_ops(model, L, seq_len)

    def beside(i):   # what stage i runs beside its layers: the embedding on the first, head and loss on the last
        return (embedding if i == 0 else []) + (head if i == L.pp - 1 else [])

    def work(i, n):
        return n * (f + b + r) + t(beside(i) + roofline.backward(beside(i)))
    # the pipeline runs at the pace of its busiest stage
    busiest, layers = max(enumerate(stage_layers(model.n_layer, L.pp)), key=lambda stage: work(*stage))
    ends_fwd = beside(busiest)
    ends_bwd = roofline.backward(ends_fwd)
    ends = ends_fwd + ends_bwd
    m = L.microbatches(global_batch)
    local = model.num_params() / (L.tp * L.pp) / (L.zero_ranks if L.zero else 1)
    opt = roofline.optimizer_op(local)
    mb = m * (layers * (f + b + r) + t(ends))
    overhead = acc.layer_overhead * m * math.ceil((model.n_layer + 2) / L.pp)
    bound = {"compute": 0.0, "memory": 0.0}
    for part, scale in ((ops + bwd + rc, m * layers), (ends, m), ([opt], 1.0)):
        for key, sec in roofline.bottleneck(part, acc, efficiency).items():
            bound[key] += scale * sec
    return {"layer_fwd": f, "layer_bwd": b, "layer_rc": r, "attention_fwd": t(core),
            "attention_bwd": t(roofline.backward(core)), "stage_bwd": layers * b + t(ends_bwd),
            "microbatches": mb + overhead, "optimizer": t([opt]), "total": mb + overhead + t([opt]),
            "bound": bound, "dispatch": overhead, "attention": attn, "global_batch": global_batch,
            "ops": {op.name: sec for op, sec in zip(ops + bwd, each)}}


def charged(cluster: Cluster, world: int) -> float:
    """Share of the pipeline bubble a step pays (module docstring): 1 with a device per rank or
    more cores than ranks; else the share of a yielded core that other work takes."""
    if not cluster.cores or world <= cluster.cores:
        return 1.0
    return min(1.0, cluster.background / cluster.cores)


def comm_times(model: ModelSpec, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
               compute=None, efficiency=None) -> dict[str, dict[str, float]]:
    """``{dim: {"bytes", "seconds", "exposed", "link"}}`` per GPU and step (:mod:`.overlap`);
    ``compute``: :func:`compute_times`'s dict (computed when not given)."""
    if not isinstance(compute, dict):
        compute = compute_times(model, layout, cluster.gpu, seq_len, global_batch, efficiency)
    return _comm_times(model, layout, cluster, seq_len, global_batch, compute)


def step_time(model: ModelSpec, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
              efficiency=None) -> dict:
    """``{"compute", "bubble", "comm": {dim: {...}}, "total", "flops", "detail"}`` in seconds
    (``efficiency``: a :class:`~minipar.plan.roofline.Efficiency`, one float for every shape, or
    None for the accelerator's own or the Table 1 fit)."""
    L = layout
    c = compute_times(model, L, cluster.gpu, seq_len, global_batch, efficiency)
    m = L.microbatches(global_batch)
    bubble = bubble_fraction(L.schedule, L.pp, m, L.v) * c["microbatches"] * charged(cluster, L.world) if L.pp > 1 else 0.0
    comm = _comm_times(model, L, cluster, seq_len, global_batch, c)
    total = c["total"] + bubble + sum(x["exposed"] for x in comm.values())
    return {"compute": c["total"], "bubble": bubble, "comm": comm, "total": total,
            "flops": step_flops(model, L, seq_len, global_batch), "detail": c}
