"""ZeRO-3 per parameter, the design of PyTorch's FSDP2 (``fully_shard``).

:class:`~minipar.zero.FullyShardedDataParallel` shards *flat units* (a unit's parameters
end to end, cut into N equal pieces, viewed from a buffer the wrapper owns). FSDP2 (Zhao
et al. 2023; PyTorch 2.4's ``fully_shard``) shards **each parameter on its first
dimension** instead: a parameter of d₀ rows becomes, on rank r, the rows

    [r·c, (r+1)·c)   of the parameter zero-padded to N·c rows,   c = ⌈d₀/N⌉

and that shard *is* the module's parameter (same name): any optimizer takes
``model.parameters()``, a checkpoint names shards by their usual names, and after backward
every ``.grad`` is its shard's gradient in the parameter's own dtype (fp32, the master
weights, also under mixed precision).

The schedule is stage 3's own (:class:`minipar.zero.stage3.UnitSchedule`), a unit being a layer;
:class:`PerParameterStorage` is what it gathers, uses, frees and reduces. One collective per
unit moves all its parameters: the shards are concatenated before it
(*copy-in*) and split back per parameter after it (*copy-out*), the two copies FSDP2 pays
for keeping parameters whole. As FSDP2 does, each gather of the next unit starts while the
current one computes (``prefetch=True``: in forward the next layer, in backward the previous
one), so at most two units are gathered at once. Memory and bytes are stage 3's:
(2 + 2 + K)Ψ/N and 3Ψ.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import all_gather, group_rank, group_size
from .flat import free_unit, gather_unit
from .persist import compute_in_fp32, persistent_parameters
from .reduce import reduce_shard
from .stage3 import UnitSchedule, unit_parameters


class _Param:
    """One parameter of a unit: where it lives, its shard, its gathered (unsharded) form."""

    def __init__(self, owners: list, p: nn.Parameter, n: int, r: int, dtype):
        if p.dim() == 0:
            raise ValueError("fully_shard shards on the first dimension; a 0-dim parameter has none")
        self.owners, self.shape, self.n = owners, p.shape, n           # owners: [(module, attr)]
        self.c = -(-p.shape[0] // n)                                   # rows per rank
        padded = torch.zeros((n * self.c, *p.shape[1:]), dtype=p.dtype, device=p.device)
        padded[:p.shape[0]] = p.detach()
        self.shard = nn.Parameter(padded[r * self.c:(r + 1) * self.c].clone())
        self.numel = self.shard.numel()                                # c·(d₁·d₂·...)
        self.unsharded = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device))

    def use(self, t: nn.Parameter) -> None:
        for owner, attr in self.owners:
            owner._parameters[attr] = t


class _Unit:
    def __init__(self, module, params: list[_Param], dtype):
        self.module, self.ps, self.dtype = module, params, dtype
        self.params = [q.unsharded for q in params]                    # what gradients arrive on
        self.S = sum(q.numel for q in params)                          # shard elements per rank
        numels = [q.unsharded.numel() for q in params]
        self.n = params[0].n                                           # full: what one gather fills,
        self.full = torch.empty(self.n * self.S, dtype=dtype, device=params[0].shard.device)
        for q, v in zip(params, self.full[:sum(numels)].split(numels)):   # its head the unsharded views
            q.unsharded.data = v.view(q.shape)
            q.use(q.shard)                                             # the module holds its shards
        free_unit(self.full)


class _CopyOut:
    """A unit's all-gather in flight (into ``full``: every rank's S shard elements in rank
    order); :meth:`wait` completes it and lays every parameter's rows out whole at the head of
    ``full``, where the unsharded parameters are views (*copy-out*)."""

    def __init__(self, unit: _Unit, handle):
        self.unit, self.handle = unit, handle

    @torch.no_grad()
    def wait(self) -> None:
        self.handle.wait()
        u = self.unit
        blocks = u.full.view(u.n, u.S).split([q.numel for q in u.ps], dim=1)
        whole = torch.cat([b.reshape(u.n * q.c, *q.shape[1:])[:q.shape[0]].reshape(-1) for q, b in zip(u.ps, blocks)])
        u.full[:whole.numel()].copy_(whole)


class PerParameterStorage:
    """Stage 3's storage with every parameter sharded on its first dimension
    (:class:`minipar.zero.stage3.Storage`). ``units``: ``[(module, [(parameter, owners)])]``
    (a unit without parameters is dropped); ``param_dtype``: of the gathered parameters;
    ``reduce_dtype``: of the gradients' reduce-scatter."""

    def __init__(self, units, group=None, param_dtype=torch.float32, reduce_dtype=None):
        self.group, self.n, self.r = group, group_size(group), group_rank(group)
        self.reduce_dtype = reduce_dtype or param_dtype
        self.units = [_Unit(m, [_Param(ow, p, self.n, self.r, param_dtype) for p, ow in ps], param_dtype)
                      for m, ps in units if ps]

    @torch.no_grad()
    def gather(self, i: int, **labels) -> _CopyOut:
        """Copy-in (this rank's shards end to end, in the gathered dtype), then the all-gather."""
        u = self.units[i]
        mine = torch.cat([q.shard.detach().reshape(-1) for q in u.ps])
        return _CopyOut(u, gather_unit(u.full, mine, self.group, async_op=True, **labels))

    def use(self, i: int, gathered: bool) -> None:
        """The module's parameters are the unsharded ones while the unit computes, else the shards."""
        for q in self.units[i].ps:
            q.use(q.unsharded if gathered else q.shard)

    def free(self, i: int) -> None:
        free_unit(self.units[i].full)

    def reduce(self, i: int) -> None:
        u = self.units[i]
        grads = []
        for q in u.ps:                                      # pad to N·c rows, one chunk per rank
            g = q.unsharded.grad if q.unsharded.grad is not None else torch.zeros_like(q.unsharded)
            padded = torch.zeros((self.n * q.c, *q.shape[1:]), dtype=self.reduce_dtype, device=g.device)
            padded[:q.shape[0]] = g
            grads.append(padded.view(self.n, -1))
            q.unsharded.grad = None
        flat = torch.cat(grads, dim=1).reshape(-1)          # copy-in: rank-major blocks of S
        mine = reduce_shard(flat, self.group, unit=i)       # this rank's S elements, averaged
        for q, g in zip(u.ps, mine.split([q.numel for q in u.ps])):   # copy-out into each shard's .grad
            g = g.view(q.shard.shape).to(q.shard.dtype)
            q.shard.grad = g.clone() if q.shard.grad is None else q.shard.grad.add_(g)

    @torch.no_grad()
    def full_params(self) -> dict[int, torch.Tensor]:
        """``{id(shard): the full fp32 parameter}`` (a collective: every rank calls it)."""
        where = {}
        for u in self.units:
            for q in u.ps:
                out = torch.empty(self.n * q.numel, dtype=q.shard.dtype, device=q.shard.device)
                all_gather(out, q.shard.detach().reshape(-1), group=self.group, name="gather_full_params")
                where[id(q.shard)] = out.view(self.n * q.c, *q.shape[1:])[:q.shape[0]].clone()
        return where

    def shard_spans(self) -> list[tuple]:
        """``((module, attribute), shard, a, b, 0)``: elements [a, b) of the flattened parameter
        registered there are this rank's rows of it, its ``shard`` (padding rows left out)."""
        out = []
        for u in self.units:
            for q in u.ps:
                row = q.numel // q.c if q.c else 0
                lo, hi = self.r * q.c, min((self.r + 1) * q.c, q.shape[0])
                if lo < hi:
                    out.append((q.owners[0], q.shard, lo * row, hi * row, 0))
        return out

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Shards and gathered buffers; the shards' and the unsharded parameters' gradients."""
        qs = [q for u in self.units for q in u.ps]
        return {"params": [q.shard for q in qs] + [u.full for u in self.units],
                "grads": [q.shard.grad for q in qs] + [q.unsharded.grad for q in qs]}

    def unit_sizes(self) -> list[int]:
        """N·S_u per unit: the elements one gather of the unit moves, padding included."""
        return [self.n * u.S for u in self.units]


def fully_shard(module: nn.Module, group=None, units=None, param_dtype=None, reduce_dtype=None,
                prefetch: bool = True, persist_below: int | None = None, persist=None,
                reshard_after_forward: bool = True, ignored_params=()) -> nn.Module:
    """Shard ``module``'s parameters in place, per parameter, over ``group``; returns it.

    ``units``: the modules gathered one at a time (default ``module.layers()``); every
    parameter must belong to one unit. ``param_dtype``: the dtype of the gathered
    parameters and of the compute (e.g. ``torch.bfloat16``); ``reduce_dtype``: of the
    gradient reduce-scatter (default ``param_dtype``). The shards stay fp32, and so do the
    persistent parameters, their modules' compute and their gradients' average. ``prefetch``:
    start the next unit's all-gather while this one computes. ``persist_below`` (elements) and
    ``persist`` (a predicate on modules): parameters left whole, replicated, their gradients
    all-reduced (:func:`~minipar.zero.persist.persistent_parameters`). ``reshard_after_forward``:
    free each unit after each use, or keep it gathered until the state's ``finish_step()``
    (:mod:`minipar.zero.stage3`: the policy under a pipeline). ``ignored_params``: left whole,
    to another state (FSDP2's name). The stage-3 state
    (:class:`~minipar.zero.stage3.UnitSchedule`) is :func:`sharded_state` ``(module)``."""
    found = unit_parameters(module, units, ignored_params)
    persistent = persistent_parameters(module, persist_below, persist, param_dtype)
    kept = {id(p) for p in persistent}                      # stay the module's own parameters
    storage = PerParameterStorage([(m, [(p, ow) for p, ow in f.values() if id(p) not in kept]) for m, f in found],
                                  group, param_dtype or torch.float32, reduce_dtype)
    module.__dict__["_fully_shard"] = UnitSchedule(storage, module, group, prefetch, persistent,
                                               reduce_dtype=storage.reduce_dtype,
                                               reshard_after_forward=reshard_after_forward)   # not a submodule
    compute_in_fp32(module, persistent, param_dtype)      # the persistent modules in fp32
    return module


def sharded_state(module: nn.Module) -> UnitSchedule:
    """The stage-3 state :func:`fully_shard` attached to ``module``: its :class:`UnitSchedule`
    (``peak_gathered_bytes``, ``gather_full_params()``, ``unit_sizes()``, ...)."""
    if "_fully_shard" not in module.__dict__:
        raise ValueError("this module was not sharded with fully_shard")
    return module.__dict__["_fully_shard"]


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full fp32 parameters of a :func:`fully_shard` ed module by their names (a
    collective: every rank calls it and gets the whole dict)."""
    return sharded_state(module).gather_full_params()


def padded_unit_sizes(module: nn.Module) -> list[int]:
    """N·S_u per unit: the elements one gather of the unit moves, padding included."""
    return sharded_state(module).unit_sizes()
