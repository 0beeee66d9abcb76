"""Tensor-parallel training in the shape of every strategy (:mod:`minipar.strategy`).

Every rank of the tensor-parallel group takes its shards of the single-device GPT
(:func:`~minipar.tensor_parallel.from_gpt`) and trains on the *whole* global batch: the
ranks split the matrices, not the data, so every rank computes the same (global) loss
and the single-process step, up to the order of floating-point sums.
"""
from __future__ import annotations

import time

from .. import precision, strategy
from ..runtime import trace
from ..activations import SavedActivations
from ..models.gpt import GPT
from ..reference import sgd
from .gpt import check, from_gpt, full_state_dict
from .ops import size_and_rank


def train(model: GPT, batches, optimizer=None, group=None, sequence_parallel: bool = False,
          dtype=None, recompute=None) -> dict:
    """Run on every rank of ``group``: train this rank's shards of ``model`` on ``batches``.
    Returns the losses, the full parameters (gathered, on group rank 0) and ``measured``:
    the last step's ``bytes_sent``, ``bytes_by_dim``, ``activations`` (bytes saved for
    backward, :class:`~minipar.activations.SavedActivations`) and ``seconds``."""
    if recompute is not None:  # the blocks' recomputation, in the config the shards are built from
        model.set_recompute(recompute)
    tp = from_gpt(model, group, sequence_parallel)
    opt = (optimizer or sgd())(tp.parameters())
    device = next(tp.parameters()).device
    losses, measured = [], {}
    for x, y in batches:
        mark, t0 = trace.mark(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with SavedActivations(tp) as saved, precision.autocast(dtype, device):
            loss = tp(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        sent = trace.bytes_by_dim(trace.since(mark))
        measured = {"bytes_sent": sent["total"], "bytes_by_dim": sent, "activations": saved.bytes,
                    "seconds": time.perf_counter() - t0}
    params = full_state_dict(tp)  # a collective; then group rank 0 keeps the model's parameters
    keep = (k for k, _ in model.named_parameters())  # a tied head is one parameter, as in the model
    full = strategy.full_params((k, params[k]) for k in keep) if size_and_rank(group)[1] == 0 else None
    return {"losses": losses, "params": full, "measured": measured}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`~minipar.tensor_parallel.check`, then :func:`train` on ``world_size`` ranks (one group)."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer,
                        **options)
