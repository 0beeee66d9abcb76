"""Train the GPT on a mesh, measured: the rank-side loop the tests, the notebook and the
benchmark share, and its checked launcher.

``train(config, batches, dp, pp, tp, seed, **kw)`` runs on every rank: it builds the mesh
and the :class:`~minipar.hybrid.HybridModel`, trains on the global ``batches``, and
returns the losses, the final single-device parameters (gathered), this rank's mesh
coordinates and what the last step measured (bytes sent by dimension, model-state
memory, seconds). :func:`run` checks the configuration, then launches ``train``.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import trace
from ..launch import launch
from ..mesh import ProcessMesh
from .config import check_config
from .model import HybridModel


def train_steps(model: HybridModel, batches) -> tuple[list[float], list[float], list[dict]]:
    """Train ``model`` on the global ``batches``: the loss and seconds of every step, and
    this rank's trace events of the last step."""
    losses, seconds = [], []
    for x, y in batches:
        mark = len(trace._events)  # not trace.events(): no copy of the whole trace per step
        losses.append(model.train_step(x, y))
        seconds.append(model.last_step["seconds"])
    return losses, seconds, trace.events()[mark:]


def train(config, batches, dp: int, pp: int, tp: int, seed: int = 0, gather: bool = True,
          **kwargs) -> dict:
    """Rank function: train ``GPT(config, seed)`` on a dp × pp × tp mesh (``kwargs``: those
    of :class:`HybridModel`). Every rank returns ``{"losses", "params", "coords",
    "bytes", "memory", "seconds", "step_events"}``; ``params`` (the gathered single-device
    state dict) only on global rank 0 when ``gather``; ``step_events`` are this rank's trace
    events of the last step."""
    mesh = ProcessMesh(dp=dp, pp=pp, tp=tp).build()
    model = HybridModel(config, mesh, seed, **kwargs)
    losses, seconds, step_events = train_steps(model, batches)
    memory = model.memory()
    params = model.full_state_dict() if gather else None
    return {"losses": losses, "params": params if dist.get_rank() == 0 else None,
            "coords": model.coords, "bytes": model.last_step["bytes"], "memory": memory,
            "seconds": seconds, "step_events": step_events}


def run(config, batches, dp: int, pp: int, tp: int, seed: int = 0, timeout: float = 120.0,
        **kwargs):
    """Driver: :func:`~minipar.hybrid.check_config` (a plain error before any process
    starts), then :func:`train` on ``dp·pp·tp`` ranks. Returns ``launch``'s results."""
    check_config(config, dp, pp, tp, dp * pp * tp, kwargs.get("microbatches", 1),
                 batches[0][0].shape[0], kwargs.get("schedule", "1f1b"),
                 kwargs.get("virtual_stages", 1), kwargs.get("sequence_parallel", False))
    return launch(train, dp * pp * tp, args=(config, batches, dp, pp, tp, seed), kwargs=kwargs,
                  timeout=timeout)
