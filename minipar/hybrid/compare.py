"""The classic comparison of strategies, measured: one model, one world, every strategy.

:func:`compare` trains the same GPT (same seed, same global batches, AdamW) on
``world_size`` ranks under each strategy of :func:`strategies` (data, tensor, pipeline
parallelism, ZeRO 1-3, 2D and 3D), all in one launch, and returns one row per strategy:

* ``memory``: the model states (parameters, gradients, optimizer state) the busiest rank
  holds, counted tensor by tensor (:func:`minipar.zero.model_state_bytes`), beside the
  formula (:func:`minipar.cost.hybrid_memory_per_rank`, :func:`minipar.cost.zero_bytes_per_rank`);
* ``sent``: bytes the busiest rank sent in one step (from its trace), beside the formula
  (:func:`minipar.cost.hybrid_comm_bytes`, :func:`minipar.cost.zero_comm_bytes`);
* ``bubble`` (pipelines only, ``None`` otherwise): idle time over compute time,
  ``(T - c)/c`` averaged over the ranks, as chapter 04 measures it
  (:func:`minipar.pipeline.bubble`: c is the time in forward, backward and optimizer
  regions, which include the tensor-parallel collectives inside a layer), beside the
  schedule's ``(p-1)/m``;
* ``step_ms``: the slowest rank's median step time;
* ``loss_error``: the largest difference from the single-process losses (all the same
  training).
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import cost, trace
from ..comm import group_rank, group_size
from ..data import shard
from ..launch import launch
from ..mesh import ProcessMesh
from ..models.gpt import GPT
from ..reference import train_reference
from ..trace import _union_length
from ..zero import model_state_bytes, wrap
from .config import check_config, num_params
from .model import HybridModel
from .train import train_steps

ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}


def strategies(world_size: int = 8, microbatches: int = 4) -> dict[str, dict]:
    """``{name: spec}``: a spec is ``{"dp", "pp", "tp", "m", "zero"}``. Pure strategies use
    all ``world_size`` ranks along one dimension; 2D and 3D split it in halves."""
    n, m, h = world_size, microbatches, world_size // 2
    q = max(world_size // 4, 1)
    return {"DP": dict(dp=n, pp=1, tp=1, m=1, zero=0),
            "ZeRO-1": dict(dp=n, pp=1, tp=1, m=1, zero=1),
            "ZeRO-2": dict(dp=n, pp=1, tp=1, m=1, zero=2),
            "ZeRO-3": dict(dp=n, pp=1, tp=1, m=1, zero=3),
            "TP": dict(dp=1, pp=1, tp=n, m=1, zero=0),
            "PP": dict(dp=1, pp=n, tp=1, m=max(m, n), zero=0),
            "2D DP×TP": dict(dp=h, pp=1, tp=2, m=1, zero=0),
            "2D PP×TP": dict(dp=1, pp=h, tp=2, m=m, zero=0),
            "3D": dict(dp=2, pp=q, tp=2, m=m, zero=0) if n >= 8 else dict(dp=2, pp=1, tp=2, m=1, zero=0),
            "3D + ZeRO-1": (dict(dp=2, pp=q, tp=2, m=m, zero=1) if n >= 8
                            else dict(dp=2, pp=1, tp=2, m=1, zero=1))}


def _zero_run(config, batches, stage: int, seed: int) -> dict:
    """ZeRO-2/3 over the whole world (their own wrappers), measured like the hybrid runs."""
    model = GPT(config, seed=seed)
    r, n = group_rank(None), group_size(None)
    fwd, opt = wrap(stage, model, torch.optim.AdamW, None, **ADAMW)
    losses, seconds = [], []
    for x, y in batches:
        mark, t0 = len(trace._events), time.perf_counter()
        opt.zero_grad()
        with trace.region("forward"):
            loss = fwd(shard(x, r, n), shard(y, r, n))
        with trace.region("backward"):
            loss.backward()
        with trace.region("optimizer"):
            opt.step()
        seconds.append(time.perf_counter() - t0)
        mean = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(mean)                     # the record only, not traced
        losses.append(mean.item() / n)
    events = trace.events()[mark:]
    memory = model_state_bytes(fwd, optimizer=opt) if stage == 3 else model_state_bytes(opt)
    return {"losses": losses, "seconds": seconds, "events": events, "memory": memory,
            "sent": sum(e["bytes_sent"] for e in events), "units": (fwd if stage == 3 else opt).unit_sizes()}


def _hybrid_run(config, batches, spec: dict, seed: int) -> dict:
    mesh = ProcessMesh(dp=spec["dp"], pp=spec["pp"], tp=spec["tp"]).build()
    model = HybridModel(config, mesh, seed, zero1=spec["zero"] == 1, microbatches=spec["m"],
                        optimizer_cls=torch.optim.AdamW, optimizer_kwargs=ADAMW)
    losses, seconds, events = train_steps(model, batches)
    return {"losses": losses, "seconds": seconds, "events": events, "memory": model.memory(),
            "sent": model.last_step["bytes"]["total"],
            "units": model.optimizer.unit_sizes() if spec["zero"] == 1 and spec["dp"] > 1 else None}


def bubble(ranks: list[list[dict]]) -> list[float]:
    """Per rank ``(T - c)/c`` for one step's events: T the span of all compute, c this
    rank's compute time (the union of its compute regions, so nested ones count once)."""
    spans = [(e["start"], e["end"]) for evs in ranks for e in evs if e["kind"] == "compute"]
    T = max(e for _, e in spans) - min(s for s, _ in spans)
    out = []
    for evs in ranks:
        c = _union_length([(e["start"], e["end"]) for e in evs if e["kind"] == "compute"])
        out.append((T - c) / c if c > 0 else float("inf"))
    return out


def measure(config, batches, specs: dict[str, dict], seed: int = 0) -> dict[str, dict]:
    """Rank function: run every strategy in ``specs`` in turn; this rank's measurements."""
    out = {}
    for name, spec in specs.items():
        torch.distributed.barrier()
        out[name] = (_zero_run(config, batches, spec["zero"], seed) if spec["zero"] >= 2
                     else _hybrid_run(config, batches, spec, seed))
    return out


def _formulas(config, spec: dict, batch: int, units) -> dict:
    psi, d, p, t, m = num_params(config), spec["dp"], spec["pp"], spec["tp"], spec["m"]
    if spec["zero"] >= 2 or (spec["zero"] == 1 and p == t == 1):
        mem = cost.zero_bytes_per_rank(units, d, spec["zero"], k=8, dtype_bytes=4)["total"]
        sent = cost.zero_comm_bytes(units, d, spec["zero"], dtype_bytes=4)
    else:
        mem = cost.hybrid_memory_per_rank(psi, d, p, t, zero1=spec["zero"] == 1)["total"]
        sent = cost.hybrid_comm_bytes(psi, config.n_layer, d, p, t, batch, config.block_size,
                                      config.n_embd, m)["total"]
    return {"memory_formula": mem, "sent_formula": sent,
            "bubble_formula": cost.bubble_fraction("1f1b", p, m) if p > 1 else None}


def compare(config, batches, world_size: int = 8, specs: dict | None = None, seed: int = 0,
            timeout: float = 300.0):
    """Driver: check every strategy, run them all in one launch of ``world_size`` ranks.
    Returns ``(rows, results)``: one dict per strategy (see the module doc) and the raw
    per-rank results (``results[rank][name]["events"]`` is the last step's trace)."""
    specs = specs or strategies(world_size)
    batch = batches[0][0].shape[0]
    for spec in specs.values():
        check_config(config, spec["dp"], spec["pp"], spec["tp"], world_size, spec["m"], batch)
    want = train_reference(GPT(config, seed=seed), batches,
                           lambda ps: torch.optim.AdamW(ps, **ADAMW))["losses"]
    results = launch(measure, world_size, args=(config, batches, specs, seed), timeout=timeout)
    rows = []
    for name, spec in specs.items():
        runs = [r[name] for r in results]
        row = {"strategy": name, "dp": spec["dp"], "pp": spec["pp"], "tp": spec["tp"], "m": spec["m"],
               "memory": max(r["memory"]["total"] for r in runs),
               "sent": max(r["sent"] for r in runs),
               "bubble": statistics.mean(bubble([r["events"] for r in runs])) if spec["pp"] > 1 else None,
               "step_ms": 1e3 * max(statistics.median(r["seconds"][1:] or r["seconds"]) for r in runs),
               "loss_error": max(abs(a - b) for r in runs for a, b in zip(r["losses"], want))}
        row.update(_formulas(config, spec, batch, runs[0]["units"]))
        rows.append(row)
    return rows, results
