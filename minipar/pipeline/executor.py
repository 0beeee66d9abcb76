"""The executor: run one rank's list of actions for one training step.

``Pipeline(stages, schedule, act_shape, group)`` holds this rank's stages (any
``nn.Module``, e.g. ``nn.Sequential`` of GPT blocks, or tensor-parallel blocks) and walks
``schedule.actions[rank]``, with ``rank`` the rank inside ``group`` (the pipeline's own
process group, so a 2D/3D mesh can run many pipelines side by side):

* ``F i s``: stage s's forward on micro-batch i; the last stage also computes
  ``loss_i / m``, so the gradients summed over the m micro-batches are those of the
  mean loss over the whole batch, as in the single-process run.
* ``B i s``: ``out.backward(grad)`` with ``grad`` the received ``∂L/∂out`` (for split
  schedules only the input gradient ``∂L/∂in``, via ``torch.autograd.grad``).
* ``W i s``: the weight gradients ``∂L/∂θ`` of micro-batch i, accumulated into ``.grad``.
* ``SEND_*``/``RECV_*``: :mod:`minipar.pipeline.stage_comm` (or ``comm=``, any module
  with the same four functions), with a tag per message so that each receive matches
  its send whatever the order of arrival.

Each stage keeps a micro-batch's input and output ("stash") from F until the backward
that no longer needs them; ``peak_stash`` reports the most held at once.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import trace
from ..comm import group_rank, group_size
from ..models import lm_loss
from . import stage_comm
from .schedules import Schedule
from .simulate import NAMES


def _reap(sends: list) -> list:
    """Complete (and record) the sends that have finished; return the others."""
    pending = []
    for h in sends:
        if all(w is None or w.is_completed() for w in h.works):
            h.wait()
        else:
            pending.append(h)
    return pending


class Pipeline:
    """One rank's part of a pipeline: its stages, the schedule, and :meth:`step`."""

    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, act_shape, group=None,
                 loss_fn=lm_loss, comm=None):
        self.group, self.schedule, self.loss_fn = group, schedule, loss_fn
        self.comm = comm or stage_comm
        self.rank = group_rank(group)
        if group_size(group) != schedule.p:
            raise ValueError(f"schedule for p={schedule.p} ranks but the group has {group_size(group)}")
        want = set(range(self.rank, schedule.n_stages, schedule.p))
        if set(stages) != want:
            raise ValueError(f"rank {self.rank} must hold stages {sorted(want)}, got {sorted(stages)}")
        self.stages = stages
        self.act_shape = act_shape if callable(act_shape) else (lambda s: tuple(act_shape))
        first = next((q for st in stages.values() for q in st.parameters()), None)
        self.dtype = first.dtype if first is not None else torch.float32
        self.device = first.device if first is not None else None
        self.peak_stash = 0

    def parameters(self):
        for s in sorted(self.stages):
            yield from self.stages[s].parameters()

    def _tag(self, kind: str, i: int, s: int) -> int:
        """A tag per message: (kind, micro-batch, sending stage)."""
        return 2 * (s * self.schedule.m + i) + (kind == "B")

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Forward and backward of one batch (gradients accumulate into ``.grad``); returns
        the batch's mean loss on the rank holding the last stage, ``None`` elsewhere."""
        sch, S, m, g = self.schedule, self.schedule.n_stages, self.schedule.m, self.group
        if inputs.shape[0] % m:
            raise ValueError(f"batch of {inputs.shape[0]} cannot be cut into m={m} equal micro-batches")
        xs, ys = inputs.chunk(m), targets.chunk(m)
        split = sch.split_backward
        inbox: dict[tuple, torch.Tensor] = {}   # received activations / gradients
        stash: dict[tuple, list] = {}           # (i, s) -> [input, output, grad of output]
        sends, loss, held = [], 0.0, 0
        self.peak_stash = 0
        for a in sch.actions[self.rank]:
            i, s = a.microbatch, a.stage
            lab = {"microbatch": i, "stage": s}
            if a.op == "RECV_F":
                inbox["F", i, s] = self.comm.recv_activation(
                    self.act_shape(s - 1), a.peer, g, self.dtype, self.device,
                    tag=self._tag("F", i, s - 1), **lab)
            elif a.op == "RECV_B":
                inbox["B", i, s] = self.comm.recv_grad(
                    self.act_shape(s), a.peer, g, self.dtype, self.device,
                    tag=self._tag("B", i, s + 1), **lab)
            elif a.op == "SEND_F":
                sends.append(self.comm.send_activation(stash[i, s][1], a.peer, g,
                                                       tag=self._tag("F", i, s), **lab))
            elif a.op == "SEND_B":
                sends.append(self.comm.send_grad(stash[i, s][3], a.peer, g,
                                                 tag=self._tag("B", i, s), **lab))
                if not split:
                    del stash[i, s]
            else:
                with trace.region(NAMES[a.op], phase=a.op, **lab):
                    if a.op == "F":
                        x = xs[i] if s == 0 else inbox.pop(("F", i, s))
                        out = self.stages[s](x)
                        if s == S - 1:
                            out = self.loss_fn(out, ys[i]) / m
                            loss += out.item()
                        stash[i, s] = [x, out, None, None]
                        held += 1
                    elif a.op == "B":
                        self._backward(stash[i, s], inbox.pop(("B", i, s), None), s, split)
                        if not split:
                            held -= 1
                            if s == 0:
                                del stash[i, s]
                    else:
                        self._weight_grad(stash.pop((i, s)), s)
                        held -= 1
                self.peak_stash = max(self.peak_stash, held)
            sends = _reap(sends)
        for h in sends:
            h.wait()
        return loss if S - 1 in self.stages else None

    def _backward(self, item: list, grad, s: int, split: bool) -> None:
        x, out = item[0], item[1]
        item[2] = grad
        if not split:
            torch.autograd.backward(out, grad)
            item[3] = x.grad if s > 0 else None
        elif s > 0:  # input gradient only; keep the graph for W
            item[3] = torch.autograd.grad(out, x, grad, retain_graph=True)[0]

    def _weight_grad(self, item: list, s: int) -> None:
        params = [q for q in self.stages[s].parameters() if q.requires_grad]
        grads = torch.autograd.grad(item[1], params, item[2], allow_unused=True)
        for q, gq in zip(params, grads):
            if gq is not None:
                q.grad = gq if q.grad is None else q.grad + gq
