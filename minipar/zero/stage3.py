"""ZeRO stage 3, P_os+g+p: parameters sharded too, gathered one unit at a time.

Rajbhandari et al. 2020, §5.3; the same design as PyTorch's FSDP (Zhao et al. 2023, §3).
Each rank keeps only its shard of every unit's (layer's) parameters; a unit's full
parameters exist only while it computes, forward or backward, and each backward leaves
this rank's shard of the mean gradient of every unit. :class:`UnitSchedule` decides when
a unit is gathered, used, freed and reduce-scattered (its contract: at most two units
gathered at once with prefetching, one without; every rank issues the same collectives in
the same order; notebook 06, "Stage 3 in time").

What gathering, using, freeing and reducing mean is the :class:`Storage`'s: flat units
(:class:`~minipar.zero.flat.FlatStorage`, FSDP's flat parameters, behind
:class:`~minipar.zero.fsdp.FullyShardedDataParallel`) or every parameter sharded on its first dimension
(:class:`~minipar.zero.per_parameter.PerParameterStorage`, FSDP2's, behind
:func:`~minipar.zero.fully_shard`).

Under a pipeline (Huang et al. 2019's m micro-batches per step) the policy
``reshard_after_forward`` decides when a unit goes back to its shards. On (``True``): after
every use, so a step gathers each unit 2m times and reduce-scatters its gradient
m times, each micro-batch's into this rank's gradient shard (accumulating). Off
(``False``, FSDP2's ``reshard_after_forward=False``, torchtitan's default under PP): a unit
gathered at its first forward stays gathered across the step's micro-batches, its
gradients accumulate whole on the gathered parameters, and :meth:`UnitSchedule.finish_step`
(after the last micro-batch's backward) frees it and reduce-scatters once: one all-gather
and one reduce-scatter per unit per step, for Ψ_s (the stage's parameters) and Ψ_s of
gradients held whole during the step.

Memory per rank (2 + 2 + K)Ψ/N (fp32: (4 + 4 + K)Ψ/N) plus the gathered units in flight
(at most two with prefetch: ``peak_gathered_bytes``, added on gather, taken off on free;
``peak_state_bytes``: parameters and gradients held at once, at most);
communication 3Ψ per step: all-gather twice, reduce-scatter once. Under mixed precision
(``param_dtype=torch.bfloat16``) the shards stay fp32 (the master weights: 4 + 4 + 8 = 16
bytes per element, the paper's 2 + 2 + 12); gathers, gathered units, activations and the
reduce-scatter are bf16. Small parameters may stay whole (:mod:`.persist`).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn as nn

from ..runtime import trace
from ..memory import state_tensors, storage_bytes
from .persist import reduce_persistent
from .reduce import OrderedReduction


class Unit(Protocol):
    module: nn.Module          # what computes (its forward hooks drive the schedule)
    params: list               # the tensors its gradients arrive on
    full: torch.Tensor         # the gathered buffer (storage freed between uses)


class Storage(Protocol):
    """How a design keeps its units; the :class:`UnitSchedule` calls only these."""
    units: Sequence[Unit]

    def gather(self, i: int, **labels):
        """Give unit i's buffer its storage back and start the all-gather of every rank's
        shard into it; returns a handle whose ``wait()`` completes it (``labels``: the trace's)."""

    def use(self, i: int, gathered: bool) -> None:
        """Make unit i's module compute with its gathered parameters (or its shards again)."""

    def free(self, i: int) -> None:
        """Release unit i's gathered buffer (the tensors, and the views autograd saved, stay)."""

    def reduce(self, i: int) -> None:
        """Reduce-scatter unit i's gradients (mean) into its shards' ``.grad`` (accumulating)."""

    # what the chapter measures
    def full_params(self) -> dict:
        """``{id(p): full fp32 value}`` for the parameters the model names (a collective)."""

    def tensors(self) -> dict:
        """``{"params": [...], "grads": [...]}``: the tensors this rank holds (memory anatomy)."""

    def unit_sizes(self) -> list[int]:
        """The unit sizes the cost formulas take."""


def unit_parameters(module: nn.Module, units=None, ignored_params=()) -> list[tuple[nn.Module, dict]]:
    """The units stage 3 gathers one at a time (``units``, default ``module.layers()``, else
    the whole module), each with ``{id(p): (p, [(owner, attribute), ...])}`` of its trainable
    parameters in ``module.parameters()`` order (one parameter may be registered twice).
    Both designs check here that every trainable parameter lies in exactly one unit;
    ``ignored_params`` (FSDP2's name) are left out, to another state (the experts' over their
    expert-dp group)."""
    ignored = {id(p) for p in ignored_params}
    mods = list(units if units is not None else (module.layers() if hasattr(module, "layers") else [module]))
    out, seen = [], {}
    for i, m in enumerate(mods):
        found = {}
        for owner in m.modules():
            for attr, p in owner.named_parameters(recurse=False, remove_duplicate=False):
                if not p.requires_grad or id(p) in ignored:
                    continue
                if seen.setdefault(id(p), i) != i:
                    raise ValueError("a parameter is shared by two units (tied weights?); "
                                     "stage 3 needs each parameter in exactly one unit")
                found.setdefault(id(p), (p, []))[1].append((owner, attr))
        out.append((m, found))
    missing = [n for n, p in module.named_parameters()
               if p.requires_grad and id(p) not in seen and id(p) not in ignored]
    if missing:
        raise ValueError(f"parameters in no unit: {missing[:3]}...; pass units= covering them")
    return out


class UnitSchedule:
    """Stage 3's schedule over a :class:`Storage`, the same for both designs.

    ``module``: the whole model (a forward of it starts a new unit order); ``persistent``:
    parameters kept whole (their gradients averaged in one all-reduce after every unit's
    reduce-scatter, in their own dtype, fp32); ``reduce_dtype``: the sharded gradients';
    ``prefetch``: start the next unit's gather early; ``reshard_after_forward``: free a unit after each use (``True``) or keep it gathered until
    :meth:`finish_step` (``False``, module docstring)."""

    def __init__(self, storage: Storage, module: nn.Module, group=None, prefetch: bool = True,
                 persistent=(), reduce_dtype=None, reshard_after_forward: bool = True):
        self.storage, self.units, self.module = storage, storage.units, module
        self.reshard = bool(reshard_after_forward)
        self.group, self.prefetch, self.persistent, self.reduce_dtype = group, prefetch, list(persistent), reduce_dtype
        n = len(self.units)
        self.gathered, self.pending, self.bw, self.t0 = [False] * n, [None] * n, [False] * n, [0.0] * n
        self.nbytes = [u.full.numel() * u.full.element_size() for u in self.units]
        self.gathered_bytes = self.peak_gathered_bytes = 0     # gathered units alive now / at most
        self.peak_held_grad_bytes = 0                          # whole gradients held for finish_step
        self.peak_state_bytes = 0                              # parameters + gradients held, at most
        self.order: list[int] = []                            # units in forward order, this forward
        self.in_backward = False
        # backward completes the units in reverse forward order; reduce them in that order
        self.reduction = OrderedReduction(self.units, lambda: list(reversed(self.order)), self.reduce,
                                          tail=lambda: reduce_persistent(self.persistent, self.group))
        module.register_forward_pre_hook(lambda m, a: self.start_forward())   # before the units' hooks
        for i, u in enumerate(self.units):
            u.module.register_forward_pre_hook(lambda m, a, i=i: self.pre_forward(i))
            u.module.register_forward_hook(lambda m, a, out, i=i: self.post_forward(i, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i, p))
        for p in self.persistent:
            p.register_post_accumulate_grad_hook(self.persistent_grad_ready)

    def start_forward(self) -> None:
        """A new forward of the model: the units' order starts again."""
        self.order = []

    # -- the schedule, in the order it runs
    # Contract:
    # Given: unit i's forward hooks call ``pre_forward(i)`` and ``post_forward(i, out)`` (which
    #     returns what the forward returns), its parameters' post-accumulate-grad hooks
    #     ``grad_ready(i, p)``; ``pre_backward(i)`` must run before unit i's backward computes, and
    #     nothing in the library calls it: autograd runs it only through a hook the schedule itself
    #     registers during the forward. ``end_backward`` runs once when a backward that reached
    #     ``pre_backward`` ends, possibly before the reduction's own end-of-backward step has
    #     reduced the units still waiting (it calls ``reduce(i)`` for them after). The units
    #     are ``self.units``, indexed in the order the model's forward runs them. Your tools:
    #     ``self.gather(i, wait=True, **labels)`` and ``self.free(i)`` (each does its work once
    #     per use and counts ``peak_gathered_bytes``), ``self.storage.use(i, gathered)``,
    #     ``self.storage.reduce(i)``, ``self.order`` (this forward's units, emptied by each forward
    #     of the model), ``self.reduction`` (an ``OrderedReduction`` over ``self.order`` reversed,
    #     ``reached(i)`` and ``grad_ready(i, p)``, that calls ``reduce(i)``), ``self.bw`` (a flag
    #     per unit), ``self.prefetch``, ``self.reshard``; ``finish_step`` (the library's) frees and
    #     reduce-scatters every unit last of all.
    # ex06.D.use: a unit's forward runs only with its parameters gathered and in use (its shards
    #     again once it returns), its backward only with them gathered.
    # ex06.D.prefetch: with ``prefetch``, a unit's gather overlaps the computation before it: when
    #     a unit starts computing, the gather of the unit that computes next (in this forward, or
    #     in this backward) is already in flight, and nothing has waited for it.
    # ex06.D.on_demand: without ``prefetch``, a unit is gathered only when it computes.
    # ex06.D.free: with ``reshard_after_forward``, in a forward a unit holds its full parameters
    #     only while it computes: none is gathered once its forward has returned.
    # ex06.D.free_again: with ``reshard_after_forward``, in a backward a unit holds its full
    #     parameters no longer than its gradients need them: none is gathered once its gradients
    #     are reduce-scattered, nor once the backward has ended.
    # ex06.D.peak: with ``reshard_after_forward``, at any time at most two units are gathered
    #     (one without prefetch), also when a unit's parameter gets no gradient on this rank.
    # ex06.D.counted: ``peak_gathered_bytes`` counts every gathered unit: the buffers are gathered
    #     and freed only through ``self.gather`` and ``self.free``.
    # ex06.D.keep: without ``reshard_after_forward``, a unit is gathered once per step, at its
    #     first forward, and freed only by ``finish_step``.
    # ex06.D.reduce: with resharding, each backward reduce-scatters every unit's gradients exactly
    #     once, after their last use (all of them in), in the reverse of this forward's order, and
    #     before the backward computes the unit that follows in that order (a unit whose gradients
    #     never come holds none of the others back).
    # ex06.D.deferred: without resharding, no unit is reduce-scattered before ``finish_step``.
    # ex06.D.repeat: every later micro-batch and step runs the schedule of the first.
    # ex06.*.train: the library's ZeRO stages 1, 2 and 3 with your code train the GPT as one
    #     process does.
    def pre_forward(self, i: int) -> None:
        """Unit i's forward is about to run."""
        # >>> ex06 D
        self.gather(i, phase="forward")
        self.order.append(i)
        self.storage.use(i, True)
        if self.prefetch and i + 1 < len(self.units):
            self.gather(i + 1, wait=False, phase="forward", prefetch=True)
        # <<< ex06 D
        self.t0[i] = trace.now()

    def post_forward(self, i: int, out):
        """Unit i's forward has returned ``out``."""
        trace.record("compute", "forward", self.t0[i], trace.now(), labels={"unit": i})
        # >>> ex06 D
        self.storage.use(i, False)
        if self.reshard:
            self.free(i)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g, i=i: self.pre_backward(i))
        return out
        # <<< ex06 D

    def pre_backward(self, i: int) -> None:
        """The gradient of one of unit i's outputs has arrived: its backward is about to run."""
        self.begin_backward()
        # >>> ex06 D
        if self.bw[i]:                                     # one hook per output tensor
            return
        self.bw[i] = True
        if self.reshard:
            self.reduction.reached(i)
        self.gather(i, phase="backward")
        pos = self.order.index(i) if i in self.order else 0
        if self.prefetch and pos > 0:
            self.gather(self.order[pos - 1], wait=False, phase="backward", prefetch=True)
        # <<< ex06 D
        self.t0[i] = trace.now()

    def begin_backward(self) -> None:
        """A unit's backward is about to run: once per backward, arrange for :meth:`end_backward`
        to run when that backward ends."""
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def reduce(self, i: int) -> None:
        """Unit i's gradients of this backward are all in (:class:`OrderedReduction` calls this,
        in its order)."""
        trace.record("compute", "backward", self.t0[i], trace.now(), labels={"unit": i})
        self.held()
        # >>> ex06 D
        self.free(i)
        self.storage.reduce(i)
        self.bw[i] = False
        # <<< ex06 D

    def grad_ready(self, i: int, p) -> None:
        """Parameter ``p`` of unit i has its gradient of this backward."""
        # >>> ex06 D
        if self.reshard:                                   # else: accumulated until finish_step
            self.reduction.grad_ready(i, p)
        # <<< ex06 D

    def persistent_grad_ready(self, p) -> None:
        """A persistent parameter has its gradient: with resharding on, this backward has started
        (its reduction's tail averages it); otherwise :meth:`finish_step` does."""
        if self.reshard:
            self.reduction.touch()

    def end_backward(self) -> None:
        """The backward has ended (an autograd callback)."""
        # >>> ex06 D
        if self.reshard:
            for i in range(len(self.units)):
                self.free(i)
        else:                                              # the next micro-batch's backward
            self.bw = [False] * len(self.units)
        # <<< ex06 D
        self.in_backward = False

    def finish_step(self) -> None:
        """After the step's last backward, with ``reshard_after_forward=False``: free every unit
        and reduce-scatter its accumulated gradients once (last unit first, the same order on
        every rank), then average the persistent parameters' gradients. With resharding on,
        every backward did this already and there is nothing to do."""
        if self.reshard:
            return
        self.held()
        held = sum(p.grad.numel() * p.grad.element_size() for u in self.units for p in u.params
                   if p.grad is not None)
        self.peak_held_grad_bytes = max(self.peak_held_grad_bytes, held)
        for i in reversed(range(len(self.units))):
            self.free(i)
            self.storage.reduce(i)
        reduce_persistent(self.persistent, self.group)
        self.bw = [False] * len(self.units)

    def held(self) -> int:
        """Bytes of parameters and gradients this rank holds now (shards, gathered units, whole and
        sharded gradients, persistent ones), kept as ``peak_state_bytes``: sampled where the step
        holds the most, at a unit's reduce-scatter and before :meth:`finish_step` frees the units
        (0 for a storage that does not list its tensors)."""
        if not hasattr(self.storage, "tensors"):
            return 0
        parts = self.memory_tensors()
        now = storage_bytes(parts["params"]) + storage_bytes(parts["grads"])
        self.peak_state_bytes = max(self.peak_state_bytes, now)
        return now

    # -- gather and free, once each per use; the gathered bytes counted as they change
    def gather(self, i: int, wait: bool = True, **labels) -> None:
        """Start unit i's gather unless it is gathered (or on its way); with ``wait``, finish it."""
        if not self.gathered[i]:
            self.pending[i] = self.storage.gather(i, unit=i, **labels)
            self.gathered[i] = True
            self.gathered_bytes += self.nbytes[i]
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        if wait and self.pending[i] is not None:
            self.pending[i].wait()
            self.pending[i] = None

    def free(self, i: int) -> None:
        if self.gathered[i]:
            self.gather(i)                                 # a gather still in flight completes first
            self.storage.free(i)
            self.gathered[i] = False
            self.gathered_bytes -= self.nbytes[i]

    # -- what the chapter measures, both designs alike
    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 parameters by the model's names (a collective: every rank calls it
        and gets the whole dict)."""
        where = self.storage.full_params()
        where.update({id(p): p.detach().clone() for p in self.persistent})
        return {n: where[id(p)] for n, p in self.module.named_parameters() if id(p) in where}

    def memory_tensors(self, optimizer=None) -> dict[str, list[torch.Tensor]]:
        """Shards, gathered buffers and persistent parameters (params); the shards', the
        gathered parameters' and the persistent gradients (grads); optimizer state."""
        parts = self.storage.tensors()
        return {"params": parts["params"] + self.persistent,
                "grads": parts["grads"] + [p.grad for p in self.persistent],
                "optimizer": state_tensors(optimizer) if optimizer is not None else []}

    def unit_sizes(self) -> list[int]:
        return self.storage.unit_sizes()

    def shard_spans(self) -> list[tuple]:
        """The storage's ``(parameter or (module, attribute), shard, a, b, s)``: which elements of
        which parameter each shard holds (checkpoints)."""
        return self.storage.shard_spans()

    def persistent_numel(self) -> int:
        """Ψ_p: the elements kept whole on every rank."""
        return sum(p.numel() for p in self.persistent)
