"""Train a layered model with a pipeline schedule: the loop every chapter and test uses.

Every rank builds the same model (same seed), keeps the stages it owns, and trains
them with :class:`~minipar.pipeline.Pipeline`; :func:`gather` puts the per-rank results
back together in the format of :func:`minipar.reference.train_reference`, so the two
can be compared with :func:`minipar.reference.assert_same_training`.
"""
from __future__ import annotations

import torch

from ..comm import group_rank
from ..reference import sgd
from .executor import Pipeline
from .partition import build_stages, layer_costs, owned_parameters, partition
from .schedules import Schedule


@torch.no_grad()
def boundary_shapes(layers, bounds: list[int], micro_input: torch.Tensor) -> dict[int, tuple]:
    """Shape of each stage's output for one micro-batch (runs the layers once)."""
    shapes, x = {}, micro_input
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        for layer in layers[a:b]:
            x = layer(x)
        shapes[s] = tuple(x.shape)
    return shapes


def train(model, batches, schedule: Schedule, make_optimizer=None, group=None,
          bounds: list[int] | None = None, comm=None) -> dict:
    """Run on every rank of ``group``: train ``model.layers()`` cut at ``bounds`` (default:
    balanced by parameter count) with ``schedule``. Returns ``losses`` (on the rank holding
    the last stage, else ``None``s), this rank's ``params`` by model name, ``peak_stash``
    and ``bounds``."""
    layers = model.layers()
    bounds = bounds or partition(layer_costs(layers), schedule.n_stages)
    if len(bounds) - 1 != schedule.n_stages:
        raise ValueError(f"{len(bounds) - 1} stages in bounds, the schedule has {schedule.n_stages}")
    stages = build_stages(layers, bounds, group_rank(group), schedule.p)
    shapes = boundary_shapes(layers, bounds, batches[0][0].chunk(schedule.m)[0])
    pipe = Pipeline(stages, schedule, shapes.__getitem__, group, comm=comm)
    opt = (make_optimizer or sgd())(list(pipe.parameters()))
    losses, peak = [], 0
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y))
        opt.step()
        peak = max(peak, pipe.peak_stash)
    params = {n: q.detach().clone() for n, q in owned_parameters(model, stages).items()}
    return {"losses": losses, "params": params, "peak_stash": peak, "bounds": bounds}


def gather(results: list[dict]) -> dict:
    """Merge the ranks' results of :func:`train`: the losses of the last stage's rank and
    every rank's parameters, plus ``peak_stash`` per rank."""
    losses = next(r["losses"] for r in results if r["losses"] and r["losses"][0] is not None)
    params = {k: v for r in results for k, v in r["params"].items()}
    return {"losses": losses, "params": params, "peak_stash": [r["peak_stash"] for r in results]}
