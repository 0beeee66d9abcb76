"""Which ZeRO stage is which object: the one dispatch, for one data-parallel group.

Rajbhandari et al. (2020) partition, by stage, the optimizer state (1), the gradients too (2)
and the parameters too (3). Stages 0-2 are optimizers over a model's units
(:data:`OPTIMIZERS`: :func:`stage_optimizer`); stage 3 changes the module itself, in either
design (:func:`shard_module`: flat units, FSDP's, or per parameter, FSDP2's). The data-parallel
strategy (:func:`minipar.zero.wrap`) and the mesh's sharding of every layout
(:func:`minipar.hybrid.sharding.build_optimizer`, dense and expert groups apart) both build
their states here.
"""
from __future__ import annotations

import torch.nn as nn

from .fsdp import FullyShardedDataParallel
from .per_parameter import fully_shard, sharded_state
from .stage0 import ReplicatedOptimizer
from .stage1 import ZeroOptimizer
from .stage2 import Zero2Optimizer

OPTIMIZERS = {0: ReplicatedOptimizer, 1: ZeroOptimizer, 2: Zero2Optimizer}
SHARDINGS = ("flat", "per-parameter")


def stage_optimizer(stage: int, units, make, group=None, **options):
    """The optimizer of ZeRO ``stage`` (0, 1 or 2) over ``units`` (lists of parameters, reduced and
    sharded in that order) on ``group``; ``make(params)`` builds the inner optimizer."""
    if stage not in OPTIMIZERS:
        raise ValueError(f"stage must be 0, 1 or 2 here (stage 3 shards the module), got {stage!r}")
    return OPTIMIZERS[stage](units, make, group=group, **options)


def shard_module(module: nn.Module, group=None, sharding: str = "flat", **options):
    """Stage 3 on ``module`` over ``group``: ``sharding="flat"`` returns the
    :class:`FullyShardedDataParallel` wrapper (its ``parameters()`` are this rank's shards);
    ``"per-parameter"`` turns the module's own parameters into shards (:func:`fully_shard`) and
    returns its stage-3 state (:func:`sharded_state`). ``options``: the design's own (units,
    prefetch, param_dtype, persistence, reshard_after_forward, ignored_params ...)."""
    if sharding == "per-parameter":
        fully_shard(module, group=group, **options)
        return sharded_state(module)
    if sharding != "flat":
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    return FullyShardedDataParallel(module, group=group, **options)
