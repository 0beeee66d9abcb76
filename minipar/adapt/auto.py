"""Measure, then choose: the planner proposes, a few real steps decide.

:func:`candidates` lists the layouts a live switch can move between on ``world_size`` ranks
(dp·pp·tp = world, tp dividing the heads, pp at most the layers, the global batch split into
dp·m equal micro-batches, ZeRO 0 or 1). For a mixture of experts: every ep dividing both dp and
the experts; no pipeline (its routing counts per micro-batch, so only layouts of one micro-batch
continue each other's training, :func:`~minipar.adapt.layout.same_step`). :func:`propose` ranks them by the planner's predicted step
time on the machine :func:`minipar.plan.measure_machine` measured
(:func:`minipar.plan.course.predict_compare`), and keeps the ``k`` best. The run then
trains ``probe`` steps on each, switching live between them (the steps are real training steps:
nothing is thrown away, the losses stay one process's), measures each one's step time (the
slowest rank's median, leaving out the first step after a switch) and :func:`decide` keeps the
fastest measured. The decision log holds both numbers per candidate, because they differ: the
planner's model of a CPU job is fitted on one strategy, and a loaded machine moves the rest."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .layout import Layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config, world_size: int, batch_size: int) -> list[Layout]:
    """Every layout of ``world_size`` ranks a switch can take for the GPT ``config`` and batch."""
    moe = getattr(config, "moe_every", 0)
    out = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            m = pp
            if config.n_head % tp or pp > config.n_layer or batch_size % (dp * m):
                continue
            if pp > 1 and (config.tie_weights or moe):
                continue
            eps = [e for e in _divisors(dp) if config.n_experts % e == 0] if moe else [1]
            for ep in eps:
                for zero in ((0, 1) if dp > 1 else (0,)):
                    out.append(Layout(dp=dp, pp=pp, tp=tp, ep=ep, zero=zero))
    return out


def propose(config, batch_size: int, world_size: int, cluster, k: int = 3, dtype: str = "fp32") -> list[dict]:
    """The ``k`` layouts with the least predicted step time: ``[{"layout", "predicted_ms"}]``
    (``dtype``: the run's, ``"fp32"`` or ``"bf16"``, as the planner counts it)."""
    from ..plan.course import predict_compare
    lays = candidates(config, world_size, batch_size)
    specs = {str(lay): {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "ep": lay.ep, "zero": lay.zero,
                        "m": lay.microbatches} for lay in lays}
    rows = predict_compare(config, batch_size, specs, cluster, dtype=dtype)
    ranked = sorted(zip(lays, rows), key=lambda r: r[1]["step_ms"])
    return [{"layout": lay, "predicted_ms": row["step_ms"]} for lay, row in ranked[:k]]


def slowest_median(seconds: list[float], device=None) -> float:
    """The median of this rank's step ``seconds`` (the first left out when there are several),
    maxed over the world: the step time every rank agrees on. A collective."""
    kept = seconds[1:] if len(seconds) > 1 else seconds
    t = torch.tensor([statistics.median(kept)], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def decide(log: list[dict]) -> dict:
    """The entry of ``log`` (``{"layout", "predicted_ms", "measured_ms"}``) measured fastest."""
    return min(log, key=lambda r: r["measured_ms"])


def fit(config, world_size: int, batch_size: int, zero: int = 0) -> Layout:
    """The layout an elastic job takes on the ``world_size`` ranks it finds (after a shrink or a
    grow): the most data parallelism the global batch allows (the least communication per step
    for a small model), then tensor parallelism, then a pipeline; ``zero`` where dp > 1."""
    lays = [lay for lay in candidates(config, world_size, batch_size) if lay.zero == (zero if lay.dp > 1 else 0)]
    if not lays:
        raise ValueError(f"no layout of {world_size} ranks fits the GPT and the global batch {batch_size}")
    return min(lays, key=lambda lay: (-lay.dp, lay.pp, -lay.tp))
