"""One data-parallel training run under any ZeRO stage, measured: the rank-side loop the
tests, the notebook and the benchmark share.

``train(stage, model, batches, optimizer_cls, **kw)`` runs on every rank of ``group``:
rank r of the group trains on its shard ``minipar.data.shard(x, r, N)`` of each global
batch, so the mean of the ranks' losses is the single-process loss. It returns the
losses, the final full parameters by name, and what the last step measured: bytes per
component (:func:`minipar.zero.memory.model_state_bytes`, activations from
:class:`~minipar.zero.memory.SavedActivations`, for stage 3 the peak bytes of gathered
units in flight) and bytes this rank sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import trace
from ..comm import group_rank, group_size
from ..data import shard
from .memory import SavedActivations, model_state_bytes
from .stage0 import ReplicatedOptimizer
from .stage1 import ZeroOptimizer
from .stage2 import Zero2Optimizer
from .stage3 import FullyShardedDataParallel

OPTIMIZERS = {0: ReplicatedOptimizer, 1: ZeroOptimizer, 2: Zero2Optimizer}


def wrap(stage: int, model: torch.nn.Module, optimizer_cls, group=None, param_dtype=None, **kwargs):
    """``(forward, optimizer)`` for ``stage``: the model (or its stage-3 wrapper) and an
    optimizer with ``zero_grad()``/``step()``. Units are ``model.layers()``."""
    if stage == 3:
        fsdp = FullyShardedDataParallel(model, group=group, param_dtype=param_dtype)
        return fsdp, optimizer_cls(fsdp.parameters(), **kwargs)
    if stage not in OPTIMIZERS:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    units = [list(m.parameters()) for m in model.layers()] if hasattr(model, "layers") else model.parameters()
    extra = {"param_dtype": param_dtype} if stage else {}
    return model, OPTIMIZERS[stage](units, optimizer_cls, group=group, **extra, **kwargs)


def train(stage: int, model, batches, optimizer_cls, group=None, param_dtype=None, **kwargs) -> dict:
    """Train ``model`` on ``batches`` under ZeRO ``stage``; every rank returns
    ``{"losses", "params", "memory", "comm_bytes", "unit_sizes"}`` (see the module doc)."""
    r, n = group_rank(group), group_size(group)
    fwd, opt = wrap(stage, model, optimizer_cls, group, param_dtype, **kwargs)
    losses, memory, sent = [], {}, 0
    for step, (x, y) in enumerate(batches):
        last = step == len(batches) - 1
        mark = len(trace.events())
        opt.zero_grad()
        with SavedActivations(model) as acts:
            loss = fwd(shard(x, r, n), shard(y, r, n))
        loss.backward()
        opt.step()
        if last:
            evs = trace.events()[mark:]
            sent = sum(e["bytes_sent"] for e in evs if e["kind"] == "comm")
            memory = model_state_bytes(fwd, optimizer=opt) if stage == 3 else model_state_bytes(opt)
            memory["activations"] = acts.bytes
            if stage == 3:
                memory["gathered_peak"] = fwd.peak_gathered_bytes
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=group)                    # for the record only, not traced
        losses.append(mean.item() / n)
    params = (fwd.gather_full_params() if stage == 3
              else {k: v.detach().float().clone() for k, v in model.named_parameters()})
    return {"losses": losses, "params": params, "memory": memory, "comm_bytes": sent,
            "unit_sizes": (fwd if stage == 3 else opt).unit_sizes()}
