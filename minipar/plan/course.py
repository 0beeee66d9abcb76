"""The planner on the course's own runs: chapter 07's comparison table, predicted.

:func:`predict_compare` predicts every row of :func:`minipar.study.compare` (same GPT, batch
and strategies) before it runs:

* **memory** (the busiest rank's model states, fp32 AdamW: 4 + 4 + 8 bytes per element),
  exactly, from the GPT's parameter shapes: each layer's elements on a rank (its tensor-parallel
  shard, :func:`minipar.tensor_parallel.shard`; layer norms, row-parallel biases and position
  embeddings replicated), each pipeline stage's layers (:func:`minipar.pipeline.partition` by
  parameter count, as the runs cut them), and ZeRO's per-layer shards padded to a multiple of
  the data-parallel size (:func:`minipar.cost.zero_bytes_per_rank` on the layers' sizes);
* **step time** from :func:`minipar.plan.step_time` on the machine
  :func:`minipar.plan.measure_machine` measured, as a ranking (:func:`spearman`: the rank
  correlation of predicted and measured step times). On a CPU each collective call's software
  cost dominates a tiny model's step: :func:`fit_call_overhead` fits that one number on one
  measured strategy (as Table 1's efficiency is fitted on published rows), the rest is predicted.

:func:`rank_correlation` measures that ranking so that a loaded machine does not decide it: every
strategy trained through one code path and one clock (:func:`timed_strategies`, the
:class:`~minipar.hybrid.HybridModel` step, ZeRO 2-3 included), the calibration and the strategies
interleaved in rounds, medians, the load average before and after (``python -m minipar.bench
planner --rho`` runs it twice).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import replace

import torch

from .. import cost
from ..hybrid.model import HybridModel
from ..mesh import ProcessMesh
from ..models.gpt import GPT
from ..pipeline import layer_costs, partition
from ..runtime import launch as launching   # called as launching.launch: looked up when called (tests replace it)
from ..study.compare import make_optimizer, strategies
from ..tensor_parallel.gpt import shard
from .calibrate import SIZES, measure_rank, machine_from, median_of_rounds
from .layout import Layout
from .models import from_gpt_config
from .step_time import step_time


def layer_elements(config, tp: int) -> list[int]:
    """Elements of each layer (embed, blocks, head) on one tensor-parallel rank."""
    gpt = GPT(config)
    names = {id(p): n for n, p in gpt.named_parameters()}
    return [sum(shard(names[id(p)], p.detach(), tp, 0).numel() for p in layer.parameters())
            for layer in gpt.layers()]


def exact_memory(config, spec: dict) -> int:
    """Model-state bytes of the busiest rank of a :func:`minipar.study.strategies` spec
    (``dp``, ``pp``, ``tp``, ``zero``), fp32 AdamW."""
    d, p, t, z = spec["dp"], spec["pp"], spec["tp"], spec["zero"]
    units = layer_elements(config, t)
    bounds = partition(layer_costs(GPT(config).layers()), p)
    stages = [units[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    if z == 0 or d == 1:
        return max(16 * sum(s) for s in stages)
    return max(int(cost.zero_bytes_per_rank(s, d, z, k=8, dtype_bytes=4)["total"]) for s in stages)


def layout_of(spec: dict, batch: int, dtype: str = "fp32") -> Layout:
    d, m = spec["dp"], spec["m"]
    return Layout(dp=d, tp=spec["tp"], pp=spec["pp"], ep=spec.get("ep", 1), zero=spec["zero"],
                  micro_batch=max(1, batch // (d * m)), dtype=dtype, sequence_parallel=False, overlap_dp=False)


def predict_compare(config, batch: int, specs: dict[str, dict], cluster, dtype: str = "fp32") -> list[dict]:
    """One row per strategy: ``{"strategy", "memory", "step_ms", "parts"}`` predicted
    (``memory``: fp32 AdamW's model states, :func:`exact_memory`, whatever ``dtype``)."""
    spec_m = from_gpt_config(config)
    rows = []
    for name, spec in specs.items():
        lay = layout_of(spec, batch, dtype)
        t = step_time(spec_m, lay, cluster, config.block_size, batch)
        rows.append({"strategy": name, "memory": exact_memory(config, spec), "step_ms": 1e3 * t["total"],
                     "parts": {"compute": t["compute"], "bubble": t["bubble"],
                               **{k: c["exposed"] for k, c in t["comm"].items()}}})
    return rows


def fit_call_overhead(config, batch: int, specs: dict[str, dict], cluster, measured_ms: float,
                      on: str = "TP"):
    """The cluster with ``call_overhead`` such that strategy ``on`` takes ``measured_ms``
    (the prediction is linear in it: seconds = without + overhead · calls)."""
    base = predict_compare(config, batch, {on: specs[on]}, cluster)[0]["step_ms"]
    one = replace(cluster, call_overhead=cluster.call_overhead + 1e-3)
    slope = predict_compare(config, batch, {on: specs[on]}, one)[0]["step_ms"] - base   # ms per ms of overhead
    k = cluster.call_overhead + 1e-3 * max(measured_ms - base, 0.0) / slope if slope > 0 else cluster.call_overhead
    return replace(cluster, call_overhead=k)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(x):   # 0-based: values below, plus the mean place among the equal ones
        return [sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x]
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 0.0


def timed_strategies(config, batches, specs: dict[str, dict], rounds: int, seed: int = 0) -> dict:
    """Rank function: seconds of each training step of every strategy in ``specs``, all through
    one code path and one clock (:class:`minipar.hybrid.HybridModel`'s ``train_step``, ZeRO 2-3
    included), interleaved: ``rounds`` times the calibration (:func:`minipar.plan.calibrate.
    measure_rank`, under ``"_calibration"``) and then every strategy in turn, so a change of the
    machine's load falls on all of them alike. Each round's first step (warm-up) is left out."""
    out = {name: [] for name in specs}
    out["_calibration"] = []
    for _ in range(rounds):
        out["_calibration"].append(measure_rank(SIZES, 5, config, 4))
        for name, spec in specs.items():
            torch.distributed.barrier()
            mesh = ProcessMesh(dp=spec["dp"], pp=spec["pp"], tp=spec["tp"]).build()
            hm = HybridModel(GPT(config, seed=seed), mesh, optimizer=make_optimizer, zero=spec["zero"],
                             microbatches=spec["m"])
            for k, (x, y) in enumerate(batches):
                hm.train_step(x, y)
                if k:
                    out[name].append(hm.last_step["seconds"])
    return out


def rank_correlation(config, batches, world_size: int = 4, rounds: int = 5, specs=None, on: str = "TP") -> dict:
    """Chapter 07's table on this machine, predicted against measured: calibrate (as
    :func:`minipar.plan.measure_machine`, the median of rounds taken between the
    strategies) and time every strategy (:func:`timed_strategies`; the slowest rank's median step), fit the one CPU number on strategy ``on``
    (:func:`fit_call_overhead`) and return ``{"rho", "predicted", "measured", "call_overhead",
    "load"}``: Spearman's ρ over the other strategies, and the load average before and after."""
    specs = specs or strategies(world_size)
    load = [os.getloadavg()[0]]
    res = launching.launch(timed_strategies, world_size, args=(config, batches, specs, rounds), timeout=900)
    machine = machine_from([median_of_rounds(r["_calibration"]) for r in res], config)
    machine["cluster"] = replace(machine["cluster"], background=load[0])   # the others' load, before ours
    measured = {k: 1e3 * max(statistics.median(r[k]) for r in res) for k in specs}
    batch = batches[0][0].shape[0]
    here = fit_call_overhead(config, batch, specs, machine["cluster"], measured[on], on=on)
    predicted = {p["strategy"]: p["step_ms"] for p in predict_compare(config, batch, specs, here)}
    others = [k for k in specs if k != on]
    load.append(os.getloadavg()[0])
    return {"rho": spearman([predicted[k] for k in others], [measured[k] for k in others]),
            "predicted": predicted, "measured": measured, "call_overhead": here.call_overhead,
            "load": load, "machine": {k: machine[k] for k in ("alpha", "beta", "flops", "bandwidth", "overhead")}}
