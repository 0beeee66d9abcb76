"""Naive model parallelism: a model too big for one device, cut by layers across ranks.

Rank r holds stage r (some consecutive layers) and nothing else. One training step:

1. forward: rank 0 runs its layers on the batch and sends the activation to rank 1,
   which runs its layers and sends on ... the last rank computes the loss;
2. backward: the last rank sends ``∂L/∂(its input)`` to the rank before it, which
   continues the backward from there (:mod:`minipar.pipeline.stage_comm`), down to rank 0.

The answer is exactly the single-process one; the price is time: only one rank works at
any moment, so with n equal stages each rank idles a fraction (n-1)/n of the step. This
idle timeline is what pipelining (micro-batches, :mod:`minipar.pipeline`) attacks.

The classic example (the LSTM language models of Zaremba et al. 2014, GNMT): the embedding
and the LSTM on one device, the large vocabulary head on the other (:func:`lstm_stages`).
Memory: each rank stores only its own parameters, gradients, optimizer state and the
activations its layers save for the backward (:func:`memory_per_rank`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import trace
from .comm import group_rank, group_size
from .models import lm_loss
from .pipeline import stage_comm
from .pipeline.partition import owned_parameters
from .pipeline.train import boundary_shapes
from .reference import sgd


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


class NaiveModelParallel:
    """This rank's stage of a model split across the ranks of ``group`` (stage = group rank)."""

    def __init__(self, stage: nn.Module, act_shapes: dict[int, tuple], group=None,
                 loss_fn=lm_loss, comm=None):
        self.stage, self.shapes, self.group, self.loss_fn = stage, act_shapes, group, loss_fn
        self.comm = comm or stage_comm
        self.rank, self.n = group_rank(group), group_size(group)
        self.activation_bytes = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward and backward of one batch; the loss on the last rank, else ``None``."""
        r, n, g, c = self.rank, self.n, self.group, self.comm
        inp = x if r == 0 else c.recv_activation(self.shapes[r - 1], r - 1, g, stage=r)
        params = {q.data_ptr() for q in self.stage.parameters()}
        saved = []

        def pack(t):  # count what autograd keeps for the backward, parameters aside
            if t.data_ptr() not in params:
                saved.append(t.numel() * t.element_size())
            return t

        with trace.region("forward", stage=r, microbatch=0, phase="F"), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.stage(inp)
            if r == n - 1:
                out = self.loss_fn(out, y)
        self.activation_bytes = sum(saved)
        send = c.send_activation(out, r + 1, g, stage=r) if r < n - 1 else None
        grad = c.recv_grad(self.shapes[r], r + 1, g, stage=r) if r < n - 1 else None
        with trace.region("backward", stage=r, microbatch=0, phase="B"):
            torch.autograd.backward(out, grad)
        if r > 0:
            c.send_grad(inp.grad, r - 1, g, stage=r).wait()
        if send is not None:
            send.wait()
        return out.item() if r == n - 1 else None


def train_naive(model, stages: list[nn.Module], batches, make_optimizer=None, group=None,
                comm=None) -> dict:
    """Run on every rank of ``group``: train ``stages[rank]`` of ``model`` (every rank builds
    the same model and ``stages``). Returns ``losses`` (last rank), this rank's ``params``
    by model name and its ``memory`` in bytes (see :func:`memory_per_rank`)."""
    if len(stages) != group_size(group):
        raise ValueError(f"{len(stages)} stages for {group_size(group)} ranks: one stage per rank")
    shapes = boundary_shapes(stages, list(range(len(stages) + 1)), batches[0][0])
    rank = group_rank(group)
    mp = NaiveModelParallel(stages[rank], shapes, group, comm=comm)
    opt = (make_optimizer or sgd())(list(stages[rank].parameters()))
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(mp.step(x, y))
        opt.step()
    params = {k: v.detach().clone() for k, v in owned_parameters(model, {rank: stages[rank]}).items()}
    return {"losses": losses, "params": params,
            "memory": memory_per_rank(stages[rank], opt, mp.activation_bytes)}


def memory_per_rank(stage: nn.Module, optimizer=None, activation_bytes: int = 0) -> dict[str, int]:
    """Bytes this rank holds: ``params``, ``grads``, ``optimizer`` state, ``activations``."""
    def size(ts):
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
    ps = list(stage.parameters())
    state = [v for s in (optimizer.state.values() if optimizer else []) for v in s.values()]
    return {"params": size(ps), "grads": size(q.grad for q in ps if q.grad is not None),
            "optimizer": size(state), "activations": int(activation_bytes)}
