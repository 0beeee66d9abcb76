"""ZeRO stage 2, P_os+g: gradients are reduce-scattered, each rank keeps only its shard.

Rajbhandari et al. 2020, §5.2. On top of stage 1, a rank never keeps the full gradients: as
soon as backward has produced a unit's (a layer's) gradients, they are flattened,
reduce-scattered (averaged) into this rank's k-element gradient shard, and dropped. Memory per rank:

    2Ψ + (2 + K)Ψ/N      (fp32: 4Ψ + (4 + K)Ψ/N)

plus, transiently, one unit's full gradients. Communication is unchanged, 2Ψ per step:
reduce-scatter during the backward, all-gather of the updated shards after the step.
"""
from __future__ import annotations

import torch

from .reduce import OrderedReduction, reduce_unit_grads
from .stage1 import ZeroOptimizer


class Zero2Optimizer(ZeroOptimizer):
    """``Zero2Optimizer(params, optimizer_cls, group=None, param_dtype=None, **kwargs)``:
    :class:`ZeroOptimizer` whose gradients are sharded too. Pass the parameters as units
    (``[list(l.parameters()) for l in model.layers()]``) so each layer's gradients are reduced
    and freed as soon as its backward is done; a single unit is reduced at the end.
    The step is stage 1's: :func:`~minipar.zero.stage1.sharded_step` on the gradient shards."""

    stage = 2

    def _setup_grads(self) -> None:
        self.flat_grads = []                                   # no full gradients kept
        self.grad_shards = [None] * len(self.units)            # this rank's k-element gradients
        last_first = list(reversed(range(len(self.units))))    # backward finishes the last unit first
        self.reduction = OrderedReduction(self.units, lambda: last_first, self._reduce_unit)
        for i, u in enumerate(self.units):
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.reduction.grad_ready(i, p))

    def _reduce_unit(self, i: int) -> None:
        """Reduce-scatter unit i's gradients into its shard (accumulating), drop the full ones."""
        mine = reduce_unit_grads(self.units[i], dtype=self.param_dtype, unit=i)
        self.grad_shards[i] = mine if self.grad_shards[i] is None else self.grad_shards[i].add_(mine)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_shards = [None] * len(self.units)
        for u in self.units:
            for p in u.params:
                p.grad = None

    def step(self) -> None:
        shards = [g if g is not None else torch.zeros_like(s, dtype=self.param_dtype)
                  for g, s in zip(self.grad_shards, self.shards)]   # no backward ran: zeros
        self._step(shards)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {**super().memory_tensors(), "grads": [g for g in self.grad_shards if g is not None]
                + [p.grad for u in self.units for p in u.params if p.grad is not None]}
