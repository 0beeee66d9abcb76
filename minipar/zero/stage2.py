"""ZeRO stage 2, P_os+g: gradients are reduce-scattered, each rank keeps only its shard.

Rajbhandari et al. 2020, §5.2. On top of stage 1, a rank never keeps the full
gradients: as soon as backward has produced every gradient of a unit (a layer), the unit's
gradients are flattened, reduce-scattered (averaged) into this rank's k-element gradient
shard, and the full ones are dropped. Memory per rank:

    2Ψ + (2 + K)Ψ/N      (fp32: 4Ψ + (4 + K)Ψ/N)

plus, transiently, one unit's full gradients. Communication is unchanged, 2Ψ per step:
reduce-scatter during the backward, all-gather of the updated shards after the step.
"""
from __future__ import annotations

import torch

from ..comm import all_gather, reduce_scatter
from .stage1 import ZeroOptimizer


class Zero2Optimizer(ZeroOptimizer):
    """``Zero2Optimizer(params, optimizer_cls, group=None, param_dtype=None, **kwargs)``:
    :class:`ZeroOptimizer` whose gradients are sharded too. Pass the parameters as units
    (``[l.parameters() for l in model.layers()]``) so each layer's gradients are reduced
    and freed as soon as its backward is done; a single unit is reduced at the end."""

    stage = 2

    def _setup_grads(self) -> None:
        self.flat_grads = []                                   # no full gradients kept
        self.grad_shards = [None] * len(self.units)        # this rank's k-element gradients
        self._ready = [set() for _ in self.units]
        self._reduced = [False] * len(self.units)
        for i, u in enumerate(self.units):
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))

    def _on_grad(self, i: int, p) -> None:
        self._ready[i].add(id(p))
        if len(self._ready[i]) == len(self.units[i].params):
            self._reduce_unit(i)

    def _reduce_unit(self, i: int) -> None:
        """Flatten unit i's gradients, reduce-scatter (mean) into its shard, drop them."""
        u = self.units[i]
        flat = u.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in u.params],
                         dtype=self.param_dtype)
        for p in u.params:
            p.grad = None
        mine = u.shard_of(flat)
        reduce_scatter(mine, flat, op="avg", group=self.group, unit=i)
        if self.grad_shards[i] is None:
            self.grad_shards[i] = mine.clone()                # k elements; `flat` is freed
        else:
            self.grad_shards[i] += mine                        # gradient accumulation
        self._ready[i].clear()
        self._reduced[i] = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_shards = [None] * len(self.units)
        for u in self.units:
            for p in u.params:
                p.grad = None

    def step(self) -> None:
        for i in range(len(self.units)):                       # units whose grads never all came
            if not self._reduced[i] and any(p.grad is not None for p in self.units[i].params):
                self._reduce_unit(i)
        for s, g in zip(self.shards, self.grad_shards):
            s.grad = None if g is None else (g if g.dtype == s.dtype else g.to(s.dtype))
        self.optim.step()
        for f, s in zip(self.flat_params, self.shards):
            all_gather(f, s.detach().to(f.dtype), group=self.group)
            if self.mixed:
                s.grad = None
        self._reduced = [False] * len(self.units)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = super().memory_tensors()
        out["grads"] = [g for g in self.grad_shards if g is not None]
        out["grads"] += [p.grad for u in self.units for p in u.params if p.grad is not None]
        return out
