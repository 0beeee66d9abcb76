"""Hybrid training in the shape of every strategy (:mod:`minipar.strategy`)."""
from __future__ import annotations

import torch.distributed as dist

from .. import strategy
from ..mesh import ProcessMesh
from .config import check
from .model import HybridModel


def train(model, batches, optimizer=None, group=None, dp: int = 1, pp: int = 1, tp: int = 1,
          cp: int = 1, ep: int = 1, **options) -> dict:
    """Rank function: build the mesh and the :class:`HybridModel` of the single-device GPT
    ``model`` over the whole world and train it on the global ``batches`` (``options``: those of
    :class:`HybridModel`: ``zero`` (0-3; ``zero1=True`` is ``zero=1``) and ``sharding``
    (:mod:`.sharding`), ``schedule``, ``microbatches``, ``virtual_stages``,
    ``sequence_parallel``, ``bounds``, ``dtype``, ``recompute``, ...; ``ep`` spreads a
    mixture-of-experts GPT's experts, :mod:`.experts`). Returns the losses, the
    final single-device parameters (gathered, on global rank 0) and what the last step measured:
    this rank's mesh ``coords``, ``bytes_by_dim`` (and ``bytes_sent``), model-state ``memory``,
    ``seconds`` and its trace ``events``."""
    if group is not None:
        raise ValueError("hybrid training lays its mesh over the whole world (group=None)")
    names = [k for k, _ in model.named_parameters()]
    mesh = ProcessMesh(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep).build()
    hybrid = HybridModel(model, mesh, optimizer=optimizer, **options)
    losses = [hybrid.train_step(x, y) for x, y in batches]
    full = hybrid.full_state_dict()                      # a collective: every rank takes part
    last = hybrid.last_step
    measured = {"coords": hybrid.coords, "bytes_by_dim": last["bytes"],
                "bytes_sent": last["bytes"]["total"], "memory": hybrid.memory(),
                "seconds": last["seconds"], "events": last["events"]}
    if hybrid.zero in (1, 2):
        measured["unit_sizes"] = hybrid.optimizer.unit_sizes()
    return {"losses": losses, "measured": measured,
            "params": strategy.full_params((k, full[k]) for k in names) if dist.get_rank() == 0 else None}


def run(model, batches, world_size: int | None = None, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`~minipar.hybrid.check` (a plain error before any process starts),
    then :func:`train` on ``world_size`` (default ``dp·pp·tp``) ranks."""
    world_size = world_size or (options.get("dp", 1) * options.get("pp", 1) * options.get("tp", 1)
                                * options.get("cp", 1))
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
