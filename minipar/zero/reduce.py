"""The gradient reduce path, P_g (Rajbhandari et al. 2020, §5.2): one copy for stages 1-3.

Of a unit's gradients, laid out flat in N·k elements, rank r ends up holding only

    ḡ_r = (1/N) Σ_j g_j[r·k : (r+1)·k]                      (k = ⌈Ψ_u/N⌉)

having sent (N-1)/N of the flat gradient's bytes: half an all-reduce. Stages 2 and 3 run it *during* the backward,
as soon as a unit's gradients are complete, through :class:`OrderedReduction`, which keeps
the rule every data-parallel reducer needs: **every rank issues the same collectives in the
same order** (a collective run on a rank-local condition leaves the other ranks waiting).
A unit is reduced once it and every unit before it in the order are complete, or once the
backward is known to have moved past it (:meth:`OrderedReduction.reached`); the rest when the
backward ends. Parameters with no gradient on this rank take part with zeros. ``tail``
runs last (stage 3's persistent parameters: one all-reduce after every unit's reduce-scatter).
"""
from __future__ import annotations

import torch

from ..comm import group_rank, group_size, reduce_scatter


# Contract:
# ex06.A.mean: ``flat_grad`` holds N·k elements for the N ranks of ``group``; the result is k
#     elements, the mean over the group's ranks of their slice ``[r·k, (r+1)·k)`` of
#     ``flat_grad``, r this rank's rank in the group.
# ex06.A.memory: the result is ``flat_grad``'s own elements ``[r·k, (r+1)·k)`` (a view, starting at
#     element r·k): no new tensor of k or N·k elements.
# ex06.A.bytes: each rank sends (N-1)/N of ``flat_grad``'s bytes, in one collective that
#     receives ``**labels``.
# ex06.*.group: on a group other than the world only its ranks take part and ranks count within
#     it (``None``: the world).
# ex06.*.recorded: data moves only through ``minipar.comm``'s collectives on flat tensors
#     (``reduce_scatter``, ``all_gather``), so the trace records every byte.
def reduce_shard(flat_grad: torch.Tensor, group=None, **labels) -> torch.Tensor:
    """This rank's k elements of the mean over ``group`` of ``flat_grad`` (N·k elements), in
    ``flat_grad``'s own memory."""
    # >>> ex06 A
    n, r = group_size(group), group_rank(group)
    k = flat_grad.numel() // n
    mine = flat_grad[r * k:(r + 1) * k]
    reduce_scatter(mine, flat_grad, op="avg", group=group, **labels)
    return mine
    # <<< ex06 A


# Contract:
# ex06.A.zeros: ``flat_unit`` is a ``FlatUnit``; the result is this rank's k elements of the mean
#     over the group of the unit's gradients laid out as ``FlatUnit.flatten`` lays out its
#     parameters; a parameter without a gradient on this rank contributes zeros.
# ex06.A.dtype: the result is in ``dtype`` (default: the parameters'), whatever the gradients'.
# ex06.A.fresh: the result is a tensor of exactly k elements that keeps no N·k-element buffer
#     alive.
# ex06.A.cleared: afterwards every parameter of the unit has ``.grad`` None.
def reduce_unit_grads(flat_unit, dtype=None, **labels) -> torch.Tensor:
    """This rank's k elements of the mean over the group of ``flat_unit``'s gradients, a tensor
    of their own; the unit's parameters hold no ``.grad`` afterwards."""
    # >>> ex06 A
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in flat_unit.params]
    flat = flat_unit.flatten(grads, dtype=dtype)
    for p in flat_unit.params:
        p.grad = None
    return reduce_shard(flat, flat_unit.group, **labels).clone()     # `flat` is freed
    # <<< ex06 A


class OrderedReduction:
    """Reduce units as their gradients complete, in one order on every rank.

    ``units``: the :class:`~minipar.zero.flat.FlatUnit` s; ``order()``: the unit indices in
    the order backward completes them (last layer first); ``reduce(i)``: what reducing unit
    i means for the stage (it calls :func:`reduce_unit_grads`). Call :meth:`grad_ready` from
    a post-accumulate-grad hook; the backward's end is caught with an autograd callback."""

    def __init__(self, units, order, reduce, tail=None):
        self.units, self.order, self.reduce, self.tail = units, order, reduce, tail
        self._reset()

    def _reset(self) -> None:
        self.ready = [set() for _ in self.units]
        self.done: set[int] = set()
        self.queue: list[int] | None = None          # this backward's order, once it started

    def _start(self) -> None:
        if self.queue is None:                       # the first event of this backward
            self.queue = list(self.order())
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def touch(self) -> None:
        """A gradient outside every unit arrived (a persistent parameter's): this backward has
        started, so the reductions left will run at its end."""
        self._start()

    def grad_ready(self, i: int, p) -> None:
        self._start()
        self.ready[i].add(id(p))
        while self.queue and len(self.ready[self.queue[0]]) == len(self.units[self.queue[0]].params):
            self._reduce(self.queue.pop(0))

    def reached(self, i: int) -> None:
        """The backward has reached unit i: every unit before i in the order is done, complete
        or not, so those are reduced now, in the order, the same on every rank."""
        self._start()
        while self.queue and self.queue[0] != i and i in self.queue:
            self._reduce(self.queue.pop(0))

    def _finish(self) -> None:
        """End of the backward: reduce every unit not yet reduced, in order (zeros for the
        gradients this rank lacks), so that all ranks ran the same collectives."""
        for i in (self.queue or []) + [j for j in range(len(self.units)) if j not in (self.queue or [])]:
            if i not in self.done:
                self._reduce(i)
        if self.tail is not None:                    # after every unit, the same on every rank
            self.tail()
        self._reset()

    def _reduce(self, i: int) -> None:
        self.done.add(i)
        self.reduce(i)
