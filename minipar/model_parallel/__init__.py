"""Naive model parallelism: a model too big for one device, cut by layers across ranks.

Rank r holds stage r (some consecutive layers) and nothing else. What crosses the cut between
two stages is only what the chain rule needs there, one tensor each way (:mod:`.stage_comm`),
and a step's loss and every gradient are exactly the single-process ones (notebook 03 shows
each rank's part on real ranks).

The price is time: only one rank works at
any moment, so with n equal stages each rank idles a fraction (n-1)/n of the step. This
idle timeline is what pipelining (micro-batches, :mod:`minipar.pipeline`) attacks.

The classic example (the LSTM language models of Zaremba et al. 2014, GNMT): the embedding
and the LSTM on one device, the large vocabulary head on the other (:func:`lstm_stages`).
Memory: each rank stores only its own parameters, gradients, optimizer state and the
activations its layers save for the backward (``measured["memory"]`` of :func:`train`).

The API is every strategy's (:mod:`minipar.strategy`): :func:`check`, :func:`train`, :func:`run`.
The cut itself is this package's, and the pipeline (chapter 04) reuses it: :mod:`.partition`
(contiguous stages of balanced cost) and :mod:`.stage_comm` (activations forward, gradients back).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from .. import strategy
from ..runtime import trace
from ..activations import SavedActivations
from ..comm import group_rank, group_size
from ..models import lm_loss
from . import stage_comm
from .partition import boundary_shapes, layer_costs, owned_parameters, partition
from ..reference import sgd
from ..memory import held_state_bytes


class LSTMBody(nn.Module):
    """Embedding then LSTM: token ids -> hidden states (the LSTM's state is dropped)."""

    def __init__(self, embed: nn.Module, lstm: nn.LSTM):
        super().__init__()
        self.embed, self.lstm = embed, lstm

    def forward(self, idx):
        return self.lstm(self.embed(idx))[0]


def lstm_stages(model) -> list[nn.Module]:
    """The two stages of :class:`minipar.models.LSTMLM`: ``[embedding + LSTM, head]``."""
    return [LSTMBody(model.embed, model.lstm), model.head]


def balanced_stages(model, n: int) -> list[nn.Module]:
    """``model.layers()`` cut into ``n`` consecutive stages of about equal parameter count."""
    layers = model.layers()
    bounds = partition(layer_costs(layers), n)
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


class NaiveModelParallel:
    """This rank's stage of a model split across the ranks of ``group`` (stage = group rank)."""

    def __init__(self, stage: nn.Module, act_shapes: dict[int, tuple], group=None,
                 loss_fn=lm_loss, dtype=None):
        self.stage, self.shapes, self.group, self.loss_fn = stage, act_shapes, group, loss_fn
        self.comm, self.dtype = stage_comm, dtype
        self.wire = stage_comm.message_dtype(stage)  # what crosses a boundary travels in, both ways
        self.device = next((q.device for q in stage.parameters()), None)  # where receives land
        self.rank, self.n = group_rank(group), group_size(group)

    # Contract:
    # Given: ``self.stage`` (this rank's layers), ``self.shapes`` (``shapes[s]``: stage s's output
    #     shape), ``self.group``, ``self.loss_fn``, ``self.comm`` (``stage_comm``), ``self.dtype``
    #     (the forward's, through ``strategy.forward``), ``self.wire`` (the dtype every message
    #     travels in, both ways: ``stage_comm.message_dtype``), ``self.device`` (where receives
    #     land), ``self.rank`` (= the stage) and ``self.n`` are set; ``x``, ``y`` are the whole
    #     batch's inputs and targets on every rank.
    # ex03.A.grad: the gradient sent back is ∂L/∂(the stage's input): the sending stage continues
    #     its backward from it, and the weight gradients on every rank are one process's.
    # ex03.A.stages: ``step`` runs one batch over any number of stages, one per rank of ``group``
    #     (the world or not), and returns the batch's loss on the last rank as a Python float,
    #     ``None`` elsewhere.
    # ex03.A.train: training with ``step`` equals one process.
    # ex03.A.precision: with ``self.dtype`` bfloat16 the stages compute as one process under the
    #     same autocast does, and every message travels in ``self.wire``.
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward and backward of one batch; the loss on the last rank, else ``None``."""
        # >>> ex03 A
        r, n, g, c = self.rank, self.n, self.group, self.comm
        inp = x if r == 0 else c.recv_activation(self.shapes[r - 1], r - 1, g, self.wire, self.device, stage=r)
        with strategy.forward(self.dtype, inp, "forward", stage=r, microbatch=0, phase="F"):
            out = self.stage(inp)
            # the last stage's loss, or the activation in the dtype both sides agree on (autograd casts back)
            out = self.loss_fn(out, y) if r == n - 1 else out.to(self.wire)
        send = c.send_activation(out, r + 1, g, stage=r) if r < n - 1 else None
        grad = c.recv_grad(self.shapes[r], r + 1, g, self.wire, self.device, stage=r) if r < n - 1 else None
        with trace.region("backward", stage=r, microbatch=0, phase="B"):
            torch.autograd.backward(out, grad)
        if r > 0:
            c.send_grad(inp.grad, r - 1, g, stage=r).wait()
        if send is not None:
            send.wait()
        return out.item() if r == n - 1 else None
        # <<< ex03 A


@strategy.checks
def check(model, batches, world_size: int, stages=None, dtype=None, recompute=None) -> None:
    """Plain errors before launch: one stage per rank, a known dtype and recompute mode."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if stages is None and len(model.layers()) < world_size:
        raise ValueError(f"{len(model.layers())} layers cannot make {world_size} stages")
    if stages is not None and len(parts := stages(model)) != world_size:
        raise ValueError(f"{len(parts)} stages for {world_size} ranks: one stage per rank")
    strategy.check_options(model, dtype, recompute)


def train(model, batches, optimizer=None, group=None, stages=None, dtype=None, recompute=None) -> dict:
    """Run on every rank of ``group``: train stage ``rank`` of ``model`` (the same on every rank).
    ``stages``: a function ``model -> [stage modules]``, one per rank (e.g. :func:`lstm_stages`;
    default :func:`balanced_stages`); ``recompute``: the GPT's (``None``: the model's own).
    Returns ``losses`` (last rank), this rank's ``params`` by model name, and ``measured``: this
    rank's ``memory`` (``params``, ``grads``, ``optimizer``, ``activations`` bytes, counted in the
    first step), the last step's ``bytes_sent``, ``bytes_by_dim`` and ``seconds``
    (:func:`minipar.strategy.loop`)."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    parts = stages(model) if stages is not None else balanced_stages(model, group_size(group))
    if len(parts) != group_size(group):
        raise ValueError(f"{len(parts)} stages for {group_size(group)} ranks: one stage per rank")
    rank = group_rank(group)
    shapes = boundary_shapes(parts, list(range(len(parts) + 1)), batches[0][0])
    mp = NaiveModelParallel(parts[rank], shapes, group, dtype=dtype)
    opt = (optimizer or sgd())(list(parts[rank].parameters()))
    saved = SavedActivations(parts[rank])

    def step(i, batch):
        opt.zero_grad(set_to_none=True)
        with saved if i == 0 else nullcontext():  # every step saves the same: count it once
            loss = mp.step(*batch)
        opt.step()
        return loss                               # the last rank's float, None elsewhere

    losses, measured = strategy.loop(batches, step, mean_over=strategy.WHOLE)
    state = held_state_bytes(parts[rank], optimizer=opt)
    measured["memory"] = {k: state[k] for k in ("params", "grads", "optimizer")} | {"activations": saved.bytes}
    return {"losses": losses if rank == len(parts) - 1 else None,
            "params": strategy.full_params(owned_parameters(model, {rank: parts[rank]}).items()),
            "measured": measured}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
