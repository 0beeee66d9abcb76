"""A data-parallel training loop, and the driver that checks the setup and launches it.

On each rank, for every global batch: take this rank's shard, split it into
``accumulation`` micro-batches, run forward and backward on each (all but the last under
``no_sync``, each loss scaled by 1/accumulation), then step the optimizer. With equal
shards the averaged gradient equals the single-process gradient of the global mean loss,
so the run matches :func:`minipar.reference.train_reference` step for step. The loss
reported for a step is the mean over ranks, which is the single-process loss.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import comm, trace
from ..launch import launch
from ..reference import sgd
from .ddp import DistributedDataParallel
from .sampler import shard_batch


def average_loss(loss: torch.Tensor, group=None) -> float:
    """The mean of ``loss`` over the ranks of ``group`` (one tiny recorded all-reduce)."""
    t = loss.detach().reshape(1).clone()
    comm.all_reduce(t, op="avg", group=group, name="loss")
    return t.item()


def train(model, batches, make_optimizer=None, group=None, accumulation: int = 1,
          **ddp_kwargs) -> dict:
    """Run on every rank of ``group``: train ``model`` wrapped in
    :class:`DistributedDataParallel` (``ddp_kwargs``) on ``batches`` (global batches).

    Returns ``{"losses": [...], "params": {name: tensor}}`` like ``train_reference``.
    """
    ddp = DistributedDataParallel(model, group=group, **ddp_kwargs)
    opt = (make_optimizer or sgd())(ddp.parameters())
    losses = []
    for step, batch in enumerate(batches):
        x, y = shard_batch(tuple(batch), group)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for j, (xm, ym) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
            last = j == accumulation - 1
            with nullcontext() if last else ddp.no_sync():
                with trace.region("forward", step=step, microbatch=j):
                    loss = ddp(xm, ym) / accumulation
                t = trace.now()
                ddp.backward_end = None
                loss.backward()  # returns once the gradients are averaged (if synced)
                # "backward" is autograd's computation; waiting for all-reduces after it is not
                trace.record("compute", "backward", t, ddp.backward_end or trace.now(),
                             step=step, microbatch=j)
            total += loss.detach()
        with trace.region("optimizer", step=step):
            opt.step()
        losses.append(average_loss(total, group))
    ddp.remove_hooks()
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in ddp.named_parameters()}}


def check_setup(batches, world_size: int, accumulation: int = 1, bucket_cap_mb=25.0) -> None:
    """Plain errors for a setup that cannot work, raised before any process starts."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be a positive int, got {accumulation!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be None (naive) or >= 0, got {bucket_cap_mb}")
    for step, (x, _) in enumerate(batches):
        if x.shape[0] % (world_size * accumulation):
            raise ValueError(
                f"global batch {step} has {x.shape[0]} samples, which {world_size} ranks x "
                f"{accumulation} micro-batches cannot split evenly (equal shards are what make "
                "the averaged gradient equal the single-process one)")


def run(model, batches, world_size: int, make_optimizer=None, accumulation: int = 1,
        timeout: float = 120.0, **ddp_kwargs):
    """Driver side: check the setup, then :func:`train` on ``world_size`` ranks.

    Returns ``minipar.launch``'s results (one dict per rank, ``.trace``)."""
    check_setup(batches, world_size, accumulation, ddp_kwargs.get("bucket_cap_mb", 25.0))
    return launch(train, world_size, args=(model, batches, make_optimizer),
                  kwargs=dict(accumulation=accumulation, **ddp_kwargs), timeout=timeout)
