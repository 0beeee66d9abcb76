"""Predict one layout: memory per GPU, step time, tokens/s, TFLOP/s per GPU and MFU.

:func:`predict` puts :mod:`.memory` and :mod:`.step_time` together for a model, a cluster and
a :class:`~minipar.plan.Layout`; the :class:`Prediction` reads as a breakdown
(``print(prediction)``). Throughput is counted two ways:

* TFLOP/s per GPU = hardware FLOPs (with recomputation, as Narayanan et al. 2021 report) / (T · N);
* MFU = model FLOPs (3 × forward, no recomputation) / (T · N · peak) (Chowdhery et al. 2022,
  "PaLM", Appendix B).

A layout fits when its total is at most ``usable`` (default 95%) of the GPU's memory; the rest
goes to the CUDA context and the allocator's fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import get_cluster
from .layout import Layout, check
from .memory import memory_per_gpu
from .models import get_model
from .step_time import step_time

USABLE = 0.95


@dataclass
class Prediction:
    model: str
    cluster: str
    layout: Layout
    seq_len: int
    global_batch: int
    memory: dict          # bytes per GPU by component, and "total"
    time: dict            # seconds: compute, bubble, comm {dim: {...}}, total
    hbm: float
    peak: float           # the accelerator's peak FLOP/s
    usable: float = USABLE

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.usable * self.hbm

    @property
    def reason(self) -> str:
        """Why it does not fit ("" when it does)."""
        if self.fits:
            return ""
        return (f"needs {self.memory['total'] / 1e9:.0f} GB per GPU, has {self.hbm / 1e9:.0f} "
                f"({self.usable * self.hbm / 1e9:.0f} usable)")

    @property
    def step_time(self) -> float:
        return self.time["total"]

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq_len / self.step_time

    @property
    def tflops_per_gpu(self) -> float:
        return self.time["flops"]["hardware"] / (self.step_time * self.layout.world) / 1e12

    @property
    def mfu(self) -> float:
        return self.time["flops"]["model"] / (self.step_time * self.layout.world * self.peak)

    def bottlenecks(self) -> dict[str, float]:
        """Seconds of the step by what bounds them: compute-bound and memory-bound operations
        (the roofline), operator dispatch (a CPU's ``layer_overhead``), the bubble, and each
        dimension's exposed communication on its link."""
        bound = self.time["detail"]["bound"]
        out = {"compute-bound": bound["compute"], "memory-bound": bound["memory"], "bubble": self.time["bubble"]}
        if self.time["detail"]["dispatch"]:                      # a CPU: operator dispatch, measured
            out["operator dispatch"] = self.time["detail"]["dispatch"]
        for d, c in self.time["comm"].items():
            out[f"exposed {d} communication ({c['link']})"] = c["exposed"]
        return out

    @property
    def bottleneck(self) -> str:
        """The largest of :meth:`bottlenecks`, with its share of the step."""
        name, sec = max(self.bottlenecks().items(), key=lambda kv: kv[1])
        return f"{name}, {sec / self.step_time:.0%} of the step"

    def components(self) -> dict[str, float]:
        """Seconds of the step by part: compute, bubble, and each dimension's exposed comm."""
        return {"compute": self.time["compute"], "bubble": self.time["bubble"],
                **{f"{d} comm": c["exposed"] for d, c in self.time["comm"].items()}}

    def __str__(self) -> str:
        GB = 1e9
        mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.memory.items() if k != "total")
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in self.components().items() if v)
        return "\n".join([f"{self.model} on {self.layout.world} × {self.cluster}: {self.layout}",
                          f"  memory per GPU {self.memory['total'] / GB:.1f} GB of {self.hbm / GB:.0f} "
                          f"({mem})" + ("" if self.fits else f"  -- does not fit: {self.reason}"),
                          f"  step {1e3 * self.step_time:.1f} ms ({parts}); bottleneck: {self.bottleneck}",
                          f"  {self.tokens_per_s:,.0f} tokens/s, {self.tflops_per_gpu:.0f} TFLOP/s per GPU, "
                          f"MFU {self.mfu:.0%}"])


def predict(model, cluster, layout: Layout, global_batch: int, seq_len: int | None = None,
            efficiency=None, nodes: int | None = None) -> Prediction:
    """Memory and step time of ``layout``: a plain ``ValueError`` if it cannot run at all; one that
    runs but does not fit in memory comes back with ``fits`` False. ``attention="auto"`` is
    resolved for the cluster's accelerator first (flash on a GPU); ``efficiency``: see
    :func:`minipar.plan.step_time`."""
    spec, cl = get_model(model), get_cluster(cluster, nodes)
    s = seq_len or spec.seq_len
    check(spec, layout, global_batch, s)
    layout = layout.replace(attention=layout.attention_on(cl.gpu), overlap_tp=layout.tp_overlap_on(cl.gpu))
    if layout.world > cl.world:
        raise ValueError(f"layout {layout} needs {layout.world} GPUs, {cl.name} has {cl.world}")
    return Prediction(spec.name, cl.name, layout, s, global_batch,
                      memory_per_gpu(spec, layout, s, global_batch),
                      step_time(spec, layout, cl, s, global_batch, efficiency), cl.gpu.hbm, cl.gpu.peak_flops)
