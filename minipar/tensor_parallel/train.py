"""Tensor-parallel training in the shape of every strategy (:mod:`minipar.strategy`).

Every rank of the tensor-parallel group takes its shards of the single-device GPT
(:func:`~minipar.tensor_parallel.from_gpt`) and trains on the *whole* global batch: the
ranks split the matrices, not the data, so every rank computes the same (global) loss
and the single-process step, up to the order of floating-point sums.
"""
from __future__ import annotations

from contextlib import nullcontext

from .. import precision, strategy
from ..activations import SavedActivations
from ..models.gpt import GPT
from ..models.recompute import check_mode
from ..reference import sgd
from .config import check_config
from .gpt import from_gpt, full_state_dict
from .ops import size_and_rank


@strategy.checks
def check(model, batches, world_size: int, sequence_parallel: bool = False, dtype=None,
          recompute=None, seq_len: int | None = None) -> None:
    """Raise a plain ``ValueError`` if the GPT ``model`` (or its ``GPTConfig``) cannot be
    split over ``world_size`` tensor-parallel ranks (:func:`.config.check_config`; call it
    before launching, :func:`run` does). With sequence parallelism the sequence length
    (``seq_len``, else the batches', else ``block_size``) must be divisible by it too."""
    c = getattr(model, "config", model)
    seq_len = seq_len or (batches[0][0].shape[1] if batches else None)
    precision.resolve(dtype)
    check_mode(recompute)  # None: the model's own
    check_config(c, world_size, sequence_parallel, seq_len)


def train(model: GPT, batches, optimizer=None, group=None, sequence_parallel: bool = False,
          dtype=None, recompute=None) -> dict:
    """Run on every rank of ``group``: train this rank's shards of ``model`` on ``batches``.
    Returns the losses, the full parameters (gathered, on group rank 0) and ``measured``:
    the last step's ``bytes_sent``, ``bytes_by_dim`` and ``seconds`` (:func:`minipar.strategy.loop`)
    and ``activations``, the bytes saved for backward (:class:`~minipar.activations.SavedActivations`),
    counted in the first step (every step saves the same; the count stays off the timed steps)."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    tp = from_gpt(model, group, sequence_parallel)
    opt = (optimizer or sgd())(tp.parameters())
    device = next(tp.parameters()).device
    saved = SavedActivations(tp)

    def step(i, batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with saved if i == 0 else nullcontext(), strategy.forward(dtype, device):
            loss = tp(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        return loss.detach()                                # every rank has the global loss

    losses, measured = strategy.loop(batches, step, mean_over=strategy.WHOLE)
    measured.memory = strategy.state_memory(tp, opt, activations=saved.bytes)
    params = full_state_dict(tp)  # a collective; then group rank 0 keeps the model's parameters
    keep = (k for k, _ in model.named_parameters())  # a tied head is one parameter, as in the model
    full = strategy.full_params((k, params[k]) for k in keep) if size_and_rank(group)[1] == 0 else None
    return {"losses": losses, "params": full, "measured": measured}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks (one group)."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer,
                        **options)
