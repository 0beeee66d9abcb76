"""The classic comparison of strategies, measured: one model, one world, every strategy.

:func:`compare` trains the same GPT (same seed, same global batches, AdamW) on
``world_size`` ranks under each strategy of :func:`strategies` (data, tensor, pipeline
parallelism, ZeRO 1-3, 2D and 3D), all in one launch, and returns one row per strategy:

* ``memory``: the model states (parameters, gradients, optimizer state) the busiest rank
  holds, counted tensor by tensor (:func:`minipar.zero.held_state_bytes`), beside the
  formula (:func:`minipar.cost.hybrid_memory_per_rank`, :func:`minipar.cost.zero_bytes_per_rank`);
* ``sent``: bytes the busiest rank sent in one step (from its trace), beside the formula
  (:func:`minipar.cost.hybrid_comm_bytes`, :func:`minipar.cost.zero_comm_bytes`);
* ``bubble`` (pipelines only, else ``None``): the last step's measured bubble, idle over
  compute time ``(T - c)/c`` averaged over the ranks (:meth:`minipar.runtime.trace.Trace.bubble`,
  as in chapter 04), beside the schedule's ``(p-1)/m``;
* ``step_ms``: the slowest rank's last step;
* ``loss_error``: the largest difference from the single-process losses (it is all the same
  training)."""
from __future__ import annotations

import statistics

import torch

from .. import cost
from ..runtime.launch import launch
from ..models.gpt import GPT
from ..reference import train_reference
from ..runtime.trace import Trace
from ..zero import train as zero_train
from ..hybrid.config import check, num_params
from ..hybrid.train import train as hybrid_train

ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}


def make_optimizer(params):
    """AdamW with :data:`ADAMW`, for every strategy compared (a factory of parameters)."""
    return torch.optim.AdamW(params, **ADAMW)


def strategies(world_size: int = 8, microbatches: int = 4) -> dict[str, dict]:
    """``{name: spec}``: a spec is ``{"dp", "pp", "tp", "m", "zero"}``. Pure strategies use
    all ``world_size`` ranks along one dimension; 2D and 3D split it in halves."""
    n, m, h = world_size, microbatches, world_size // 2
    three = dict(dp=2, pp=max(n // 4, 1), tp=2, m=m) if n >= 8 else dict(dp=2, pp=1, tp=2, m=1)
    return {"DP": dict(dp=n, pp=1, tp=1, m=1, zero=0),
            **{f"ZeRO-{z}": dict(dp=n, pp=1, tp=1, m=1, zero=z) for z in (1, 2, 3)},
            "TP": dict(dp=1, pp=1, tp=n, m=1, zero=0),
            "PP": dict(dp=1, pp=n, tp=1, m=max(m, n), zero=0),
            "2D DP×TP": dict(dp=h, pp=1, tp=2, m=1, zero=0),
            "2D PP×TP": dict(dp=1, pp=h, tp=2, m=m, zero=0),
            "3D": dict(three, zero=0), "3D + ZeRO-1": dict(three, zero=1)}


def measure(config, batches, specs: dict[str, dict], seed: int = 0) -> dict[str, dict]:
    """Rank function: train every strategy in ``specs`` in turn, each through its own
    ``train`` (:mod:`minipar.strategy`); this rank's ``losses`` and ``measured`` per strategy."""
    out = {}
    for name, spec in specs.items():
        torch.distributed.barrier()
        model = GPT(config, seed=seed)
        out[name] = (zero_train(model, batches, make_optimizer, stage=spec["zero"]) if spec["zero"] >= 2 else
                     hybrid_train(model, batches, make_optimizer, dp=spec["dp"], pp=spec["pp"], tp=spec["tp"],
                                  zero=spec["zero"], microbatches=spec["m"]))
        out[name].pop("params")
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
    per-rank results (``results[rank][name]["measured"]``; for the mesh strategies its
    ``"events"`` are the last step's trace)."""
    specs = specs or strategies(world_size)
    batch = batches[0][0].shape[0]
    for spec in specs.values():
        check(config, batches, world_size, spec["dp"], spec["pp"], spec["tp"], spec["m"])
    want = train_reference(GPT(config, seed=seed), batches, make_optimizer)["losses"]
    results = launch(measure, world_size, args=(config, batches, specs, seed), timeout=timeout)
    rows = []
    for name, spec in specs.items():
        runs = [r[name]["measured"] for r in results]
        bubble = statistics.mean(Trace([r["events"] for r in runs]).bubble()) if spec["pp"] > 1 else None
        row = {"strategy": name, "dp": spec["dp"], "pp": spec["pp"], "tp": spec["tp"], "m": spec["m"],
               "memory": max(r["memory"]["total"] for r in runs), "sent": max(r["bytes_sent"] for r in runs),
               "bubble": bubble, "step_ms": 1e3 * max(r["seconds"] for r in runs),
               "loss_error": max(abs(a - b) for r in results for a, b in zip(r[name]["losses"], want))}
        rows.append(row | _formulas(config, spec, batch, runs[0].get("unit_sizes")))
    return rows, results
