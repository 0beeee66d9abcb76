"""Data-parallel training in the shape of every strategy (:mod:`minipar.strategy`).

On each rank, for every global batch: take this rank's shard, split it into ``accumulation``
micro-batches, run forward and backward on each (all but the last under ``no_sync``, each loss
scaled by 1/accumulation), then step: with equal shards the run matches
:func:`minipar.reference.train_reference` step for step (:mod:`.naive` says why), and a step's
loss, the mean over ranks, is the single-process loss.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import strategy
from ..runtime import trace
from ..reference import sgd
from .ddp import DistributedDataParallel
from .sampler import shard_batch


def train(model, batches, optimizer=None, group=None, accumulation: int = 1, dtype=None,
          recompute=None, bucket_cap_mb: float | None = 25.0, overlap: bool = True,
          all_reduce_fn=None) -> dict:
    """Run on every rank of ``group``: train ``model`` wrapped in :class:`DistributedDataParallel`
    (``bucket_cap_mb``, ``overlap``, ``all_reduce_fn``: its options) on the global ``batches``;
    ``recompute`` is the GPT's (:meth:`~minipar.models.GPT.set_recompute`; ``None``: the model's
    own). ``measured``: the last step's ``bytes_sent``, ``bytes_by_dim`` and ``seconds``
    (:func:`minipar.strategy.loop`)."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    ddp = DistributedDataParallel(model, group=group, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
                                  all_reduce_fn=all_reduce_fn)
    opt = (optimizer or sgd())(ddp.parameters())
    device = next(model.parameters()).device

    def step(i, batch):
        x, y = shard_batch(tuple(batch), group)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for j, (xm, ym) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
            with nullcontext() if j == accumulation - 1 else ddp.no_sync():
                with strategy.forward(dtype, device, "forward", step=i, microbatch=j):
                    loss = ddp(xm, ym) / accumulation
                trace.backward(loss, step=i, microbatch=j)  # gradients averaged if synced
            total += loss.detach().float()
        with trace.region("optimizer", step=i):
            opt.step()
        return total

    losses, measured = strategy.loop(batches, step, mean_over=group)
    measured.memory = strategy.state_memory(ddp, opt)
    ddp.remove_hooks()
    return {"losses": losses, "params": strategy.full_params(ddp.named_parameters()), "measured": measured}


@strategy.checks
def check(model, batches, world_size: int, accumulation: int = 1, dtype=None, recompute=None,
          bucket_cap_mb: float | None = 25.0, overlap: bool = True, all_reduce_fn=None) -> None:
    """Plain errors for a setup that cannot work, raised before any process starts."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be a positive int, got {accumulation!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be None (naive) or >= 0, got {bucket_cap_mb}")
    strategy.check_options(model, dtype, recompute)
    for step, (x, _) in enumerate(batches):
        if x.shape[0] % (world_size * accumulation):
            raise ValueError(f"global batch {step} has {x.shape[0]} samples, which {world_size} ranks x "
                             f"{accumulation} micro-batches cannot split evenly (equal shards are what "
                             "make the averaged gradient equal the single-process one)")


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks (a
    :class:`~minipar.strategy.TrainResult`, with the run's ``trace``)."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
