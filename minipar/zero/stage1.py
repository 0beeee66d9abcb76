"""ZeRO stage 1, P_os: each rank keeps optimizer state only for its shard of the parameters.

Rajbhandari et al. 2020, §5.1. With N data-parallel ranks every rank still holds the full
parameters and full gradients, but the optimizer (its momentum, variance, and under mixed
precision the fp32 master weights) exists only for this rank's 1/N shard:

    memory per rank   2Ψ + 2Ψ + KΨ/N      (fp32: 4Ψ + 4Ψ + KΨ/N with K = 8 for Adam)

One step (:func:`sharded_step`), per unit of the flat layout (:mod:`minipar.zero.flat`):

1. reduce-scatter the gradients, averaged: rank r receives the mean over ranks of its
   shard only ((N-1)/N·Ψ sent per rank, half an all-reduce);
2. the wrapped optimizer steps this shard (its state has k = ⌈Ψ_u/N⌉ elements);
3. all-gather the updated shards so every rank ends with identical full parameters
   ((N-1)/N·Ψ): 2Ψ per step in all, the same as plain data parallelism.

Works with any *element-wise* torch optimizer (SGD, Adam, AdamW, ...): on a flat shard it
does exactly what it would do on the parameters. Norm-based ones (LAMB, clipping by the
global norm) would need a further all-reduce and are not covered.
"""
from __future__ import annotations

import torch

from ..comm import all_gather, group_rank, reduce_scatter
from .flat import FlatUnit, split_units
from .memory import state_tensors


def sharded_step(flat_params, flat_grads, shards, optimizer, group=None) -> None:
    """One ZeRO-1 step over the units u (lists of the same length, same order on every rank).

    ``flat_params[u]``, ``flat_grads[u]``: the unit's full flat padded vectors (N·k
    elements); ``shards[u]``: the k-element leaf tensor the ``optimizer`` owns (a view
    of this rank's slice of ``flat_params[u]`` in fp32, or its fp32 master copy under
    mixed precision). Afterwards ``flat_params[u]`` holds every rank's updated shard.
    """
    for g, s in zip(flat_grads, shards):
        k = s.numel()
        r = group_rank(group)
        mine = g[r * k:(r + 1) * k]
        reduce_scatter(mine, g, op="avg", group=group)          # in place: mine = mean of chunk r
        s.grad = mine if mine.dtype == s.dtype else mine.to(s.dtype)
    optimizer.step()
    for f, s in zip(flat_params, shards):
        all_gather(f, s.detach().to(f.dtype), group=group)      # in place for the fp32 view


class ZeroOptimizer:
    """``ZeroOptimizer(params, optimizer_cls, group=None, param_dtype=None, **kwargs)``.

    ``params``: the model's parameters (one unit) or a list of units (lists of
    parameters, e.g. ``[l.parameters() for l in model.layers()]``). ``optimizer_cls``
    and ``kwargs`` build the wrapped optimizer, on this rank's shards only. ``group``:
    the data-parallel process group (None = world; ranks are group-local). With
    ``param_dtype=torch.bfloat16`` the model computes in bf16 from bf16 parameters and
    gradients while the optimizer keeps fp32 master shards (counted as optimizer state).

    Use it like a torch optimizer: ``zero_grad()``, ``loss.backward()``, ``step()``.
    The model's parameters become views into flat buffers (their ``.data`` changes).
    """

    stage = 1

    def __init__(self, params, optimizer_cls, group=None, param_dtype=None, **kwargs):
        self.group = group
        units = split_units(params)
        dtypes = {p.dtype for u in units for p in u}
        if dtypes != {torch.float32}:
            raise ValueError(f"{type(self).__name__} expects fp32 parameters (they become the "
                             f"master weights), got {dtypes}")
        self.units = [FlatUnit(ps, group) for ps in units]
        self.param_dtype = param_dtype or torch.float32
        self.mixed = self.param_dtype != torch.float32
        self.flat_params, self.shards = [], []
        for u in self.units:
            master = u.flatten(u.params)                       # fp32, N·k
            flat = master.to(self.param_dtype) if self.mixed else master
            shard = u.shard_of(master).clone() if self.mixed else u.shard_of(flat)
            u.use(flat)
            self.flat_params.append(flat)
            self.shards.append(torch.nn.Parameter(shard))      # shares memory with `shard`
        self._setup_grads()
        self.optim = optimizer_cls(self.shards, **kwargs)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    # -- gradients: stage 1 keeps full flat gradients; the params' .grad are views into them
    def _setup_grads(self) -> None:
        self.flat_grads = [torch.zeros(u.padded, dtype=self.param_dtype) for u in self.units]
        self._point_grads()

    def _point_grads(self) -> None:
        for u, g in zip(self.units, self.flat_grads):
            for p, v in zip(u.params, u.views(g)):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                    if p.grad is not None:                     # someone replaced it: keep its value
                        v.copy_(p.grad)
                    p.grad = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (in place: the flat buffers are kept for the next backward)."""
        for g in self.flat_grads:
            g.zero_()
        self._point_grads()

    def step(self) -> None:
        self._point_grads()
        sharded_step(self.flat_params, self.flat_grads, self.shards, self.optim, self.group)
        if self.mixed:
            for s in self.shards:
                s.grad = None                                  # the fp32 copy was temporary

    # -- memory anatomy (see minipar.zero.memory.model_state_bytes)
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by component: parameters, gradients, optimizer
        state (per-element state, plus the fp32 master shards under mixed precision)."""
        return {"params": list(self.flat_params), "grads": list(self.flat_grads),
                "optimizer": state_tensors(self.optim) + (list(self.shards) if self.mixed else [])}

    def unit_sizes(self) -> list[int]:
        """Ψ_u of every unit (for :func:`minipar.cost.zero_bytes_per_rank`)."""
        return [u.numel for u in self.units]
