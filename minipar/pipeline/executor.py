"""The executor: one rank walks its list of actions, top to bottom, for one training step.

``Pipeline(stages, schedule, act_shape, group)`` holds this rank's stages (any ``nn.Module``)
and runs ``schedule.actions[rank]`` (:mod:`.schedules`), ``rank`` being the rank inside
``group``, the pipeline's own process group (so a mesh can run many pipelines side by side).
Each action is the method of its name:

* ``F i s``, ``B i s``: stage s's forward and backward of micro-batch i; together the step's
  gradients are those of the batch's mean loss, and what a backward needs is held in the
  *stash* only while it is needed.
* ``W i s``: under ZB-H1 (:mod:`~minipar.autograd.split_backward`) B computes the input
  gradients and W the weight gradients.
* ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``: activations and gradients (:mod:`.stage_comm`);
  each run of them between two computes is one batch under NCCL (:func:`minipar.comm.p2p.batched`:
  separate posts of a send and a receive, in opposite orders on neighbouring ranks, can wait on
  each other for ever). Under NCCL the rank walks :func:`.posting.lockstep` of the schedule: the
  same computes and sends, each receive moved up into the batch of the round its message is
  sent in, so that no schedule's batches can wait on each other in a cycle (interleaved 1F1B
  with m > p would, receives right before their computes). Elsewhere (Gloo) the schedule as
  it is: a receive blocks there, and is best posted when it is needed.

Measurement stays beside the walk: each F, B, W runs inside its trace region (:func:`traced`)
labelled ``phase``, ``microbatch``, ``stage``; :class:`Mailbox` carries the messages (a
receive gets its own, whatever the order of arrival); :class:`Stash` counts the
micro-batches held at once (``peak_stash`` after a step).
"""
from __future__ import annotations

import itertools
from contextlib import nullcontext

import torch
import torch.nn as nn

from .. import strategy
from ..runtime import trace
from ..comm import group_rank, group_size
from ..comm import p2p
from ..comm.p2p import batched
from ..models import lm_loss
from ..model_parallel import stage_comm
from .posting import lockstep
from .schedules import COMPUTE, Schedule
from .simulate import NAMES
from ..autograd.split_backward import WeightGrads, deferred


def traced(a):
    """The trace region of one compute action (F, B or W), labelled ``phase``, ``microbatch``, ``stage``."""
    return trace.region(NAMES[a.op], phase=a.op, microbatch=a.microbatch, stage=a.stage)


class Pipeline:
    """One rank's part of a pipeline: its stages, the schedule, and :meth:`step`.
    ``dtype``: the forward's compute dtype under autocast (``None``: fp32). ``schedule`` is the
    one walked: under NCCL :func:`.posting.lockstep` of the one given (receives posted ahead)."""

    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, act_shape, group=None,
                 loss_fn=lm_loss, dtype=None):
        self.group, self.schedule, self.loss_fn, self.rank = group, schedule, loss_fn, group_rank(group)
        if group_size(group) != schedule.p:
            raise ValueError(f"schedule for p={schedule.p} ranks but the group has {group_size(group)}")
        want = set(range(self.rank, schedule.n_stages, schedule.p))
        if set(stages) != want:
            raise ValueError(f"rank {self.rank} must hold stages {sorted(want)}, got {sorted(stages)}")
        self.stages, self.last = stages, schedule.n_stages - 1
        self.split_backward = schedule.split_backward  # read once: it scans every rank's actions
        first = next((q for st in stages.values() for q in st.parameters()), None)
        self.compute_dtype, self.device = dtype, first.device if first is not None else None
        if p2p.moved_by_nccl(torch.empty(0, device=self.device), group):
            self.schedule = lockstep(schedule)  # NCCL pairs posts in order: receives posted by rounds
        self.mail = Mailbox(stage_comm, group, schedule.m,
                            act_shape if callable(act_shape) else (lambda s: tuple(act_shape)),
                            stage_comm.message_dtype(*stages.values()), self.device)
        self.peak_stash = 0

    def parameters(self):
        for s in sorted(self.stages):
            yield from self.stages[s].parameters()

    # Contract:
    # Given: ``step`` walks ``self.schedule.actions[self.rank]``, each action by the method of its
    #     name. The library's ``F``, ``B`` and ``W`` (exercise 03's part C) take micro-batch i's
    #     inputs and targets from ``self.xs[i]`` and ``self.ys[i]``, leave the step's loss in
    #     ``self.loss`` (which the step sets to 0) and keep their state in ``self.inbox``,
    #     ``self.outbox`` (both keyed ``(kind, micro-batch, stage)``) and ``self.stash`` (a
    #     ``Stash``: a dict that counts its ``peak``); ``self.mail`` is exercise 03's ``Mailbox``;
    #     ``SEND_F``/``RECV_F`` also serve ``SEND_B``/``RECV_B`` (``a.op[-1]`` is the kind).
    # ex04.C.divide: a batch m does not divide is a ValueError.
    # ex04.C.loss: ``step`` returns the batch's mean loss on the rank holding the last stage,
    #     None elsewhere.
    # ex04.C.clean: a second step starts from a clean state (its losses are one process's too).
    # ex04.C.peak: afterwards ``self.peak_stash`` is the most micro-batches held at once.
    # ex04.C.sent: when ``step`` returns, every message the step sent has completed and is
    #     recorded: one ``comm`` event with its bytes per send of the schedule.
    # ex04.C.batched: every send and receive is posted inside a ``batched()`` block
    #     (``minipar.comm.p2p``), one block per run of messages between two computes (under NCCL
    #     a block is one batch; Gloo's messages go out at once either way).
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Forward and backward of one batch (gradients accumulate into ``.grad``); returns
        the batch's mean loss on the rank holding the last stage, ``None`` elsewhere."""
        # >>> ex04 C
        m = self.schedule.m
        if inputs.shape[0] % m:
            raise ValueError(f"batch of {inputs.shape[0]} cannot be cut into m={m} equal micro-batches")
        self.xs, self.ys, self.loss = inputs.chunk(m), targets.chunk(m), 0.0
        self.stash, self.inbox, self.outbox = Stash(), {}, {}
        for compute, run in itertools.groupby(self.schedule.actions[self.rank], lambda a: a.op in COMPUTE):
            with nullcontext() if compute else batched():  # a run of sends and receives: one NCCL batch
                for a in run:
                    getattr(self, a.op)(a)
        self.mail.flush()
        self.peak_stash = self.stash.peak
        return float(self.loss) if self.last in self.stages else None  # the step's one host read
        # <<< ex04 C

    # ------------------------------------------------------------------ compute
    # Contract:
    # Given: each of ``F(a)``, ``B(a)``, ``W(a)`` runs inside its trace region for an action ``a``
    #     of stage ``a.stage`` on micro-batch ``a.microbatch``. The step has cut the batch into
    #     ``self.xs`` and ``self.ys`` (m micro-batches each) and set ``self.loss = 0``;
    #     ``self.inbox`` holds what ``RECV_F``/``RECV_B`` received and ``self.outbox`` what
    #     ``SEND_F``/``SEND_B`` will send, both keyed ``(kind, micro-batch, stage)`` (kind "F" or
    #     "B"); ``self.stash`` is a ``Stash`` (a dict counting its ``peak``); ``self.stages``,
    #     ``self.last`` (the last stage's index), ``self.schedule`` (``m``, ``split_backward``),
    #     ``self.split_backward``, ``self.loss_fn``, ``self.compute_dtype`` and ``self.device``
    #     are the pipeline's; ``deferred`` and ``WeightGrads`` (``minipar.autograd.split_backward``)
    #     split a backward.
    # ex03.C.mean: the step's loss and gradients are those of the mean of its m micro-batches'
    #     losses.
    # ex03.C.backward: B continues the backward from the gradient ``RECV_B`` left (the last stage
    #     from its own loss) and leaves ∂L/∂(its input) for ``SEND_B``.
    # ex03.C.stash: a micro-batch's tensors are held only while a later action of it still needs
    #     them: the step's ``peak_stash`` is the schedule's.
    # ex03.C.split: with ``schedule.split_backward`` (ZB-H1), B computes the input gradients only
    #     and W the weight gradients.
    # ex03.C.dtype: the forward computes in ``compute_dtype`` (``minipar.strategy.forward``, the one
    #     place a forward enters autocast).
    def F(self, a):
        with traced(a):
            # >>> ex03 C
            i, s = a.microbatch, a.stage
            x = self.xs[i] if s == 0 else self.inbox.pop(("F", i, s))
            dw = WeightGrads() if self.split_backward else None
            with strategy.forward(self.compute_dtype, self.device or "cpu"), \
                    (deferred(dw) if dw is not None else nullcontext()):
                out = self.stages[s](x)
                if s == self.last:
                    out = self.loss_fn(out, self.ys[i]) / self.schedule.m
                    self.loss = self.loss + out.detach().double()  # on the device: no host read per micro-batch
            self.stash[i, s] = (x, out, dw)
            if s < self.last:
                self.outbox["F", i, s] = out
            # <<< ex03 C

    def B(self, a):
        with traced(a):
            # >>> ex03 C
            i, s = a.microbatch, a.stage
            x, out, dw = self.stash.pop((i, s))
            grad = self.inbox.pop(("B", i, s), None)
            torch.autograd.backward(out, None if grad is None else grad.to(out.dtype))
            if s > 0:
                self.outbox["B", i, s] = x.grad
            if dw is not None:
                self.stash[i, s] = dw          # W still needs each linear layer's (X, ∂L/∂Y)
            # <<< ex03 C

    def W(self, a):
        with traced(a):
            # >>> ex03 C
            self.stash.pop((a.microbatch, a.stage)).apply()
            # <<< ex03 C

    # ------------------------------------------------------------------ communication
    def SEND_F(self, a):  # also SEND_B: a.op[-1] is the kind, "F" or "B"
        # >>> ex04 C
        self.mail.send(a, self.outbox.pop((a.op[-1], a.microbatch, a.stage)))
        # <<< ex04 C

    def RECV_F(self, a):  # also RECV_B
        # >>> ex04 C
        self.inbox[a.op[-1], a.microbatch, a.stage] = self.mail.recv(a)
        # <<< ex04 C

    SEND_B, RECV_B = SEND_F, RECV_F


class Stash(dict):
    """``(micro-batch, stage) -> what its backward still needs``; ``peak``: most held at once."""

    peak = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.peak = max(self.peak, len(self))


class Mailbox:
    """The messages between a pipeline's stages in one step (contract ex03.B)."""

    # Contract:
    # Given: the executor calls ``Mailbox(comm, group, m, act_shape, dtype, device)`` (``comm``:
    #     ``stage_comm``; ``act_shape(s)``: stage s's output shape for one micro-batch; ``dtype``:
    #     the stages' parameters'), ``send(a, tensor)`` for a ``SEND_F``/``SEND_B`` action ``a``
    #     (``a.op``, ``a.microbatch``, ``a.stage``, ``a.peer``), ``recv(a)`` for a
    #     ``RECV_F``/``RECV_B`` and ``flush()`` at the end of the step. An action's ``a.stage`` is
    #     the stage of this rank it serves (a ``SEND_F``'s computed what it sends, a ``RECV_F``'s
    #     computes with what arrives), ``a.peer`` the group rank at the other end. The schedule may
    #     receive in any order.
    # ex03.B.match: a receive gets the message of its own kind, micro-batch and sending stage,
    #     whatever the order the messages were sent in.
    # ex03.B.dtype: every message travels in the dtype of the stages' parameters (a float64
    #     model's in float64).
    # ex03.B.flush: sends never block the schedule, yet every send is waited on, and recorded, by
    #     the end of the step, on the pipeline's ``group``.
    def __init__(self, comm, group, m: int, act_shape, dtype, device):
        # >>> ex03 B
        self.comm, self.group, self.m, self.act_shape = comm, group, m, act_shape
        self.dtype, self.device, self.pending = dtype, device, []
        # <<< ex03 B

    def send(self, a, tensor: torch.Tensor) -> None:
        # >>> ex03 B
        # finished sends are completed (and recorded) now, the others kept for later
        for h in [h for h in self.pending if all(w is None or w.is_completed() for w in h.works)]:
            h.wait()
            self.pending.remove(h)
        forward, sender = a.op == "SEND_F", a.stage
        fn = self.comm.send_activation if forward else self.comm.send_grad
        tag = 2 * (sender * self.m + a.microbatch) + (not forward)   # one per (kind, micro-batch, sender)
        self.pending.append(fn(tensor.detach().to(self.dtype), a.peer, self.group, microbatch=a.microbatch,
                               stage=a.stage, tag=tag))
        # <<< ex03 B

    def recv(self, a) -> torch.Tensor:
        # >>> ex03 B
        forward = a.op == "RECV_F"
        sender = a.stage - 1 if forward else a.stage + 1
        fn = self.comm.recv_activation if forward else self.comm.recv_grad
        return fn(self.act_shape(a.stage - 1 if forward else a.stage), a.peer, self.group, self.dtype, self.device,
                  tag=2 * (sender * self.m + a.microbatch) + (not forward), microbatch=a.microbatch, stage=a.stage)
        # <<< ex03 B

    def flush(self) -> None:
        """The end of the step."""
        # >>> ex03 B
        for h in self.pending:
            h.wait()
        self.pending = []
        # <<< ex03 B
