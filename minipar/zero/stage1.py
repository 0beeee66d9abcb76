"""ZeRO stage 1, P_os: each rank keeps optimizer state only for its shard of the parameters.

Rajbhandari et al. 2020, §5.1. With N data-parallel ranks every rank still holds the full
parameters and gradients, but the optimizer (momentum, variance and, under mixed precision,
the fp32 master weights) exists only for this rank's 1/N shard:

    memory per rank   2Ψ + 2Ψ + KΨ/N      (fp32: 4Ψ + 4Ψ + KΨ/N with K = 8 for Adam)

After a step, per unit of the flat layout (:mod:`minipar.zero.flat`), every rank holds the
parameters of one optimizer step on the mean gradient, although each rank only ever had the
mean of its own 1/N of the gradient (k = ⌈Ψ_u/N⌉ elements) and stepped only that shard's
state. Bytes sent per rank and step: 2·(N-1)/N·Ψ, as in plain data parallelism.

Any *element-wise* torch optimizer (SGD, Adam, AdamW, ...) does on a flat shard what it does
on the parameters. After :meth:`ZeroOptimizer.step` the parameters' ``.grad`` are **not**
the averaged gradient (only this rank's chunk was reduced): take a gradient norm from the
reduced shards, as ``max_grad_norm=`` does (``self.grad_norm``: the norm before clipping).
"""
from __future__ import annotations

import torch

from ..comm import all_gather
from .clip import clip_grad_norm_
from .flat import FlatUnit, split_units
from ..memory import state_tensors
from .reduce import reduce_shard


# Contract:
# ex06.B.full_step: lists over the units, the same length and order on every rank:
#     ``grad_shards[u]`` this rank's k reduced gradient elements, ``shards[u]`` the k-element leaf
#     the ``optimizer`` owns, ``flat_params[u]`` the unit's N·k parameters; afterwards every rank's
#     ``flat_params`` hold the parameters of one optimizer step on the mean gradient.
# ex06.B.state: the optimizer only ever sees (and keeps state for) this rank's shards.
# ex06.B.dtypes: the gradient, the shard and the flat parameters may have three dtypes (mixed
#     precision); each tensor keeps its own.
def sharded_step(flat_params, grad_shards, shards, optimizer, group=None) -> None:
    """P_os (§5.1): one optimizer step of the full parameters, the optimizer seeing only this
    rank's shards.

    Lists over the units u, the same length and order on every rank. ``grad_shards[u]``:
    this rank's k reduced gradient elements; ``shards[u]``: the k-element leaf tensor the
    ``optimizer`` owns; ``flat_params[u]``: the unit's full flat padded parameters (N·k),
    which afterwards hold every rank's updated shard."""
    # >>> ex06 B
    for s, g in zip(shards, grad_shards):
        s.grad = g if g.dtype == s.dtype else g.to(s.dtype)
    optimizer.step()
    for f, s in zip(flat_params, shards):
        all_gather(f, s.detach().to(f.dtype), group=group)      # in place for the fp32 view
    # <<< ex06 B


class ZeroOptimizer:
    """``ZeroOptimizer(params, optimizer_cls, group=None, param_dtype=None, max_grad_norm=None, **kwargs)``.

    ``params``: the model's parameters (one unit) or a list of units (lists of parameters,
    e.g. ``[list(l.parameters()) for l in model.layers()]``). ``optimizer_cls`` and
    ``kwargs`` build the wrapped optimizer on this rank's shards only (a class such as
    ``torch.optim.AdamW`` with its keywords, or a factory ``params -> optimizer`` such as
    :func:`minipar.reference.adamw`). ``max_grad_norm``: clip by the global norm of the
    averaged gradient before each step. ``group``: the data-parallel process group (None =
    world; ranks are group-local). With ``param_dtype=torch.bfloat16`` the model computes in
    bf16 from bf16 parameters and gradients; the optimizer keeps fp32 master shards (counted
    as optimizer state). Use it like a torch optimizer: ``zero_grad()``, ``loss.backward()``,
    ``step()``. The model's parameters become views into flat buffers (their ``.data`` changes)."""

    stage = 1

    # Contract:
    # Given: ``params`` arrives split into units (lists of fp32 parameters); the library's code
    #     after your part builds the flat gradients and the optimizer on ``self.shards``.
    # ex06.B.views: ``self.units`` (``FlatUnit`` s), ``self.flat_params`` and ``self.shards`` (one
    #     each per unit), ``self.param_dtype`` (default fp32) and ``self.mixed`` (whether it is
    #     not fp32) are set, as the library's code reads them; the model's parameters are views into ``self.flat_params``, in
    #     ``param_dtype`` (default fp32); the optimizer's shards are fp32 leaves: this rank's
    #     slice of the flat parameters, or, under ``param_dtype=torch.bfloat16``, their own
    #     master copy.
    def __init__(self, params, optimizer_cls, group=None, param_dtype=None, max_grad_norm=None, **kwargs):
        self.group, self.max_grad_norm, self.grad_norm = group, max_grad_norm, None
        units = split_units(params)
        dtypes = {p.dtype for u in units for p in u}
        if dtypes != {torch.float32}:
            raise ValueError(f"{type(self).__name__} expects fp32 parameters (they become the "
                             f"master weights), got {dtypes}")
        # >>> ex06 B
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
        # <<< ex06 B
        self._setup_grads()
        self.optim = optimizer_cls(self.shards, **kwargs)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    # -- gradients: stage 1 keeps full flat gradients; the params' .grad are views into them
    def _setup_grads(self) -> None:
        self.flat_grads = [torch.zeros(u.padded, dtype=self.param_dtype, device=u.params[0].device)
                           for u in self.units]
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

    # Contract:
    # Given: ``self.flat_grads`` holds one flat N·k gradient per unit, in ``param_dtype``, that the
    #     parameters' ``.grad`` are views of (``self._point_grads()`` points them there again);
    #     ``self.optim`` is the wrapped optimizer on ``self.shards``. ``_step(grad_shards)`` takes
    #     this rank's reduced gradient shards, one per unit (stage 2 calls it with its own) and
    #     does the rest of the step; ``clip_grad_norm_(grads, max_norm, group)`` clips shards by
    #     the norm over the group and returns it.
    # ex06.B.step: ``step()`` equals the wrapped optimizer's step on the mean gradient over the
    #     group.
    # ex06.B.clip: with ``max_grad_norm``, the step's gradient is clipped by its global norm over
    #     the group (``self.grad_norm``: the norm before clipping).
    # ex06.B.no_copy: after a bf16 step no fp32 gradient copy is left on the shards.
    # ex06.B.second: a second step after the first (another gradient) is as exact as the first.
    def step(self) -> None:
        # >>> ex06 B
        self._point_grads()
        self._step([reduce_shard(g, self.group) for g in self.flat_grads])
        # <<< ex06 B

    def _step(self, grad_shards) -> None:
        """The rest of :meth:`step` from this rank's reduced gradient shards (stage 2 enters here)."""
        # >>> ex06 B
        if self.max_grad_norm is not None:
            self.grad_norm = clip_grad_norm_(grad_shards, self.max_grad_norm, self.group)
        sharded_step(self.flat_params, grad_shards, self.shards, self.optim, self.group)
        if self.mixed:
            for s in self.shards:
                s.grad = None                                  # the fp32 copy was temporary
        # <<< ex06 B

    # -- memory anatomy (see minipar.memory.held_state_bytes)
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by component: parameters, gradients, optimizer
        state (per-element state, plus the fp32 master shards under mixed precision)."""
        return {"params": list(self.flat_params), "grads": list(self.flat_grads),
                "optimizer": state_tensors(self.optim) + (list(self.shards) if self.mixed else [])}

    def unit_sizes(self) -> list[int]:
        """Ψ_u of every unit (for :func:`minipar.cost.zero_bytes_per_rank`)."""
        return [u.numel for u in self.units]

    # -- what a checkpoint saves (minipar.production.checkpoint)
    def shard_states(self) -> list[tuple[FlatUnit, torch.Tensor, dict]]:
        """Per unit: its layout (:meth:`FlatUnit.shard_spans`: the parameters this rank's shard
        covers), the shard the wrapped optimizer steps, and that optimizer's state of it (a dict,
        empty before the first step: a loader fills it in place)."""
        return [(u, s, self.optim.state[s]) for u, s in zip(self.units, self.shards)]
