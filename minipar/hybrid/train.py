"""Hybrid training in the shape of every strategy (:mod:`minipar.strategy`).

The mesh is laid over the whole world, so :func:`train` takes no ``group`` and :func:`run`
takes the ``world_size`` every strategy takes: the product of the mesh's dimensions
(``dp·pp·tp·cp``; ep is carved out of dp·cp), checked before launch.
"""
from __future__ import annotations

import inspect

import torch.distributed as dist

from .. import strategy
from ..mesh import ProcessMesh
from .config import check
from .model import HybridModel
from .parallelize import Parallelism


def train(model, batches, optimizer=None, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1,
          zero: int = 0, sharding: str = "flat", schedule: str = "1f1b",
          microbatches: int = 1, virtual_stages: int = 1, sequence_parallel: bool = False,
          bucket_cap_mb: float = 25.0, bounds: list[int] | None = None, dtype=None, recompute=None,
          layout: str = "zigzag", variant: str = "ring", reshard_after_forward: str = "auto",
          dp_shard: int | None = None) -> dict:
    """Rank function: build the mesh and the :class:`HybridModel` of the single-device GPT
    ``model`` over the whole world and train it on the global ``batches`` (the options are
    :class:`~minipar.hybrid.parallelize.Parallelism`'s: ``zero`` (0-3) and ``sharding``
    (:mod:`.sharding`; stage 3's ``reshard_after_forward``: ``"auto"|"always"|"never"``; ``dp_shard``:
    HSDP, ZeRO-3 within blocks of ``dp_shard`` data-parallel ranks, :mod:`.hsdp`), ``schedule``, ``microbatches``, ``virtual_stages``,
    ``sequence_parallel``, ``bounds``, ``dtype``, ``recompute`` (``None``: the model's own), cp's
    ``layout`` and ``variant``; ``ep`` spreads a mixture-of-experts GPT's experts, :mod:`.experts`).
    Every step is :meth:`HybridModel.step` in :func:`minipar.strategy.loop`. Returns the losses,
    the final single-device parameters (gathered, on global rank 0) and what the last step
    measured: this rank's mesh ``coords``, ``bytes_by_dim`` (and ``bytes_sent``), model-state
    ``memory`` (between steps; under ZeRO-3 also ``peak_state_bytes``, the most held at once during
    the step), ``seconds`` and its trace ``events``."""
    plan = check(model, batches, dist.get_world_size(), dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, zero=zero,
                 sharding=sharding, schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                 sequence_parallel=sequence_parallel, bucket_cap_mb=bucket_cap_mb, bounds=bounds, dtype=dtype,
                 recompute=recompute, layout=layout, variant=variant,
                 reshard_after_forward=reshard_after_forward, dp_shard=dp_shard)
    return train_plan(model, batches, optimizer, {"dp": dp, "pp": pp, "tp": tp, "cp": cp, "ep": ep}, plan)


def train_plan(model, batches, optimizer, degrees: dict, plan: Parallelism) -> dict:
    """Rank function: :func:`train` with its options already decided, the mesh's ``degrees``
    (``{"dp", "pp", "tp", "cp", "ep"}``) and the ``plan`` :func:`~minipar.hybrid.check` returned
    (what :func:`run` launches: the driver decides, the ranks build)."""
    names = [k for k, _ in model.named_parameters()]
    mesh = ProcessMesh(**degrees).build()
    hybrid = HybridModel(model, mesh, optimizer=optimizer, plan=plan)
    losses, measured = strategy.loop(batches, lambda i, batch: hybrid.step(*batch), **hybrid.loss_groups,
                                     events=True)
    if "events" in measured:                             # a step ran
        hybrid.last_step = hybrid.step_record(measured)
        measured.bytes_by_dim = hybrid.last_step["bytes"]
    full = hybrid.full_state_dict()                      # a collective: every rank takes part
    measured.update(coords=hybrid.coords, memory=hybrid.memory())
    measured.update(hybrid.parts.dp.measured(measured["memory"]))   # ZeRO's units and peaks
    return {"losses": losses, "measured": measured,
            "params": strategy.full_params((k, full[k]) for k in names) if dist.get_rank() == 0 else None}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`~minipar.hybrid.check` (a plain error before any process starts: the
    product of the mesh's dimensions must be ``world_size``) decides the plan once, then
    :func:`train_plan` builds and trains it on ``world_size`` ranks."""
    launching = {k: options.pop(k) for k in ("timeout", "launch_options") if k in options}   # strategy.run's own
    degrees = {k: options.pop(k) for k in ("dp", "pp", "tp", "cp", "ep") if k in options}
    plan = check(model, batches, world_size, **degrees, **options)
    only_checked = sorted(set(options) - set(inspect.signature(train).parameters))
    if only_checked:   # e.g. seq_len: nothing the ranks could use
        raise ValueError(f"hybrid.train takes no option {', '.join(map(repr, only_checked))}")
    degrees = {k: degrees.get(k, 1) for k in ("dp", "pp", "tp", "cp", "ep")}
    return strategy.run(train_plan, model, batches, world_size, optimizer=optimizer, degrees=degrees, plan=plan,
                        **launching)
