"""Stage 0, plain data parallelism: the baseline ZeRO removes redundancy from.

Every rank holds the full parameters, gradients and optimizer state (2Ψ + 2Ψ + KΨ bytes
with mixed-precision Adam; 4Ψ + 4Ψ + 8Ψ in fp32), and the gradients are all-reduced,
averaged, before every step (2(N-1)/N·Ψ sent per rank). It shares the interface of
:class:`minipar.zero.ZeroOptimizer`, so the chapter measures all stages with the same code.
"""
from __future__ import annotations

import torch

from ..comm import all_reduce
from .flat import split_units
from ..memory import state_tensors


class ReplicatedOptimizer:
    """``ReplicatedOptimizer(params, optimizer_cls, group=None, max_grad_norm=None, **kwargs)``:
    averages every gradient over ``group`` with one all-reduce per parameter (zeros for a
    parameter without a gradient on this rank), optionally clips, then steps the full optimizer."""

    stage = 0

    def __init__(self, params, optimizer_cls, group=None, max_grad_norm=None, **kwargs):
        self.group, self.max_grad_norm, self.grad_norm = group, max_grad_norm, None
        self.units = split_units(params)
        self.params = [p for u in self.units for p in u]
        self.optim = optimizer_cls(self.params, **kwargs)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            all_reduce(p.grad, op="avg", group=self.group)
        if self.max_grad_norm is not None:   # every rank holds the whole averaged gradient
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).item()
        self.optim.step()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.params), "grads": [p.grad for p in self.params],
                "optimizer": state_tensors(self.optim)}

    def unit_sizes(self) -> list[int]:
        return [sum(p.numel() for p in u) for u in self.units]
