"""The composition's fourth step: the model cut into pipeline stages, this rank's kept."""
from __future__ import annotations

from ..model_parallel.partition import build_stages, layer_costs, partition
from .schedules import make_schedule


def apply_pp(model, full_layers, pp_rank: int, mesh, plan):
    """``(bounds, stages, schedule)``: ``plan.bounds`` or the single-device ``full_layers`` cut into
    pp·v stages balanced by parameter count (:func:`~minipar.pipeline.partition`), the stages of
    pipeline coordinate ``pp_rank`` built from ``model``'s layers (as the earlier steps made them),
    and the schedule ``plan.schedule`` of ``plan.microbatches`` micro-batches."""
    bounds = list(plan.bounds) if plan.bounds else partition(layer_costs(full_layers), mesh.pp * plan.virtual_stages)
    stages = build_stages(model.layers(), bounds, pp_rank, mesh.pp)
    schedule = make_schedule(plan.schedule, mesh.pp, plan.microbatches, plan.virtual_stages)
    return bounds, stages, schedule
