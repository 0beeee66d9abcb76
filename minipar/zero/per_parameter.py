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

The schedule is stage 3's own (:class:`minipar.zero.stage3.Schedule`), a unit being a layer.
One collective per unit moves all its parameters: the shards are concatenated before it
(*copy-in*) and split back per parameter after it (*copy-out*), the two copies FSDP2 pays
for keeping parameters whole. As FSDP2 does, each gather of the next unit starts while the
current one computes (``prefetch=True``: in forward the next layer, in backward the previous
one), so at most two units are gathered at once. Memory and bytes are stage 3's:
(2 + 2 + K)Ψ/N and 3Ψ.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import trace
from ..comm import all_gather, group_rank, group_size, reduce_scatter
from .reduce import OrderedReduction
from .persist import persistent_parameters
from .stage3 import Schedule


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
        self.full = torch.empty(sum(numels), dtype=dtype, device=params[0].shard.device)
        for q, v in zip(params, self.full.split(numels)):              # unsharded = views of full
            q.unsharded.data = v.view(q.shape)
        self.full.untyped_storage().resize_(0)
        self.bw, self.gathered, self.pending, self.t0 = False, False, None, 0.0   # pending: (handle, buffer)


def fully_shard(module: nn.Module, group=None, units=None, param_dtype=None, reduce_dtype=None,
                prefetch: bool = True, persist_below: int | None = None, persist=None) -> nn.Module:
    """Shard ``module``'s parameters in place, per parameter, over ``group``; returns it.

    ``units``: the modules gathered one at a time (default ``module.layers()``); every
    parameter must belong to one unit. ``param_dtype``: the dtype of the gathered
    parameters and of the compute (e.g. ``torch.bfloat16``); ``reduce_dtype``: of the
    gradient reduce-scatter (default ``param_dtype``). The shards stay fp32. ``prefetch``:
    start the next unit's all-gather while this one computes. ``persist_below`` (elements) and
    ``persist`` (a predicate on modules): parameters left whole, replicated, their gradients
    all-reduced (:func:`~minipar.zero.stage3.persistent_parameters`)."""
    _FullyShard(module, group, units, param_dtype, reduce_dtype, prefetch, persist_below, persist)
    return module


class _FullyShard(Schedule):
    def __init__(self, module, group, units, param_dtype, reduce_dtype, prefetch, persist_below=None,
                 persist=None):
        self.param_dtype, self.prefetch = param_dtype or torch.float32, prefetch
        self.reduce_dtype = reduce_dtype or self.param_dtype
        mods = list(units if units is not None else
                    (module.layers() if hasattr(module, "layers") else [module]))
        found, seen = [], {}                  # per unit {id(p): (p, [(owner, attr)])}, checked first
        for i, m in enumerate(mods):
            found.append({})
            for owner in m.modules():
                for attr, p in owner._parameters.items():
                    if p is None or not p.requires_grad:
                        continue
                    if seen.setdefault(id(p), i) != i:
                        raise ValueError("a parameter is shared by two units (tied weights?); "
                                         "fully_shard needs each parameter in exactly one unit")
                    found[i].setdefault(id(p), (p, []))[1].append((owner, attr))   # may appear twice
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
        if missing:
            raise ValueError(f"parameters in no unit: {missing[:3]}...; pass units= covering them")
        self.group, self.n, self.r = group, group_size(group), group_rank(group)
        self.persistent = persistent_parameters(module, persist_below, persist, param_dtype)
        kept = {id(p) for p in self.persistent}        # stay the module's own parameters
        sharded = [(m, [(p, ow) for p, ow in f.values() if id(p) not in kept]) for m, f in zip(mods, found)]
        self.units = [_Unit(m, [_Param(ow, p, self.n, self.r, self.param_dtype) for p, ow in ps],
                            self.param_dtype) for m, ps in sharded if ps]
        self._order: list[int] = []
        self.peak_gathered_bytes = 0                        # most bytes of gathered units at once
        module.register_forward_pre_hook(lambda m, a: self._order.clear())   # before the units' hooks
        for i, u in enumerate(self.units):
            for q in u.ps:
                q.use(q.shard)
                q.unsharded.register_post_accumulate_grad_hook(lambda p, i=i: self.reduction.grad_ready(i, p))
            u.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            u.module.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))
        self.reduction = OrderedReduction(self.units, lambda: list(reversed(self._order)), self._reduce,
                                          tail=self._reduce_persistent)
        self._watch_persistent()
        module.__dict__["_fully_shard"] = self            # not an nn.Module attribute
        self.module_ref = lambda: module

    @torch.no_grad()
    def _gather(self, i: int, wait: bool = True, **labels) -> None:
        """Gather unit i: copy-in and start the all-gather (unless started already); with
        ``wait``, finish it and copy out into each parameter's unsharded form."""
        u = self.units[i]
        if not u.gathered:
            u.gathered = True
            u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
            mine = torch.cat([q.shard.detach().reshape(-1) for q in u.ps]).to(u.dtype)   # copy-in
            gathered = torch.empty(self.n * u.S, dtype=u.dtype, device=mine.device)
            u.pending = (all_gather(gathered, mine, group=self.group, async_op=True, unit=i, **labels),
                         gathered)
            live = sum(v.full.untyped_storage().nbytes() for v in self.units)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)
        if wait and u.pending is not None:
            handle, gathered = u.pending
            handle.wait()
            for q, block in zip(u.ps, gathered.view(self.n, u.S).split([q.numel for q in u.ps], dim=1)):
                q.unsharded.data.copy_(block.reshape(self.n * q.c, *q.shape[1:])[:q.shape[0]])  # copy-out
            u.pending = None

    def _use(self, i: int, gathered: bool) -> None:
        """The module's parameters are the unsharded ones while the unit computes, else the shards."""
        for q in self.units[i].ps:
            q.use(q.unsharded if gathered else q.shard)

    def _reduce(self, i: int) -> None:
        u = self.units[i]
        trace.record("compute", "backward", u.t0, trace.now(), unit=i)
        grads = []
        for q in u.ps:                                      # pad to N·c rows, one chunk per rank
            g = q.unsharded.grad if q.unsharded.grad is not None else torch.zeros_like(q.unsharded)
            padded = torch.zeros((self.n * q.c, *q.shape[1:]), dtype=self.reduce_dtype, device=g.device)
            padded[:q.shape[0]] = g
            grads.append(padded.view(self.n, -1))
            q.unsharded.grad = None
        flat = torch.cat(grads, dim=1).reshape(-1)          # copy-in: rank-major blocks of S
        self._free(i)
        mine = flat[self.r * u.S:(self.r + 1) * u.S]
        reduce_scatter(mine, flat, op="avg", group=self.group, unit=i)
        for q, g in zip(u.ps, mine.split([q.numel for q in u.ps])):   # copy-out into each shard's .grad
            g = g.view(q.shard.shape).to(q.shard.dtype)
            q.shard.grad = g.clone() if q.shard.grad is None else q.shard.grad.add_(g)
        u.bw = False

    # -- what the chapter measures, FullyShardedDataParallel's interface
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 parameters by their names (a collective: every rank calls it)."""
        where = {}
        for u in self.units:
            for q in u.ps:
                out = torch.empty(self.n * q.numel, dtype=q.shard.dtype, device=q.shard.device)
                all_gather(out, q.shard.detach().reshape(-1), group=self.group, name="gather_full_params")
                where[id(q.shard)] = out.view(self.n * q.c, *q.shape[1:])[:q.shape[0]].clone()
        where.update({id(p): p.detach().clone() for p in self.persistent})
        return {n: where[id(p)] for n, p in self.module_ref().named_parameters() if id(p) in where}

    def memory_tensors(self, optimizer=None) -> dict[str, list[torch.Tensor]]:
        """Shards, gathered buffers and persistent parameters (params), shard, unsharded and
        persistent gradients, optimizer state."""
        from .memory import state_tensors
        qs = [q for u in self.units for q in u.ps]
        return {"params": [q.shard for q in qs] + [u.full for u in self.units] + self.persistent,
                "grads": [q.shard.grad for q in qs] + [q.unsharded.grad for q in qs]
                + [p.grad for p in self.persistent],
                "optimizer": state_tensors(optimizer) if optimizer is not None else []}

    def unit_sizes(self) -> list[int]:
        """N·S_u per unit: the elements one gather of the unit moves, padding included."""
        return [self.n * u.S for u in self.units]


def sharded_state(module: nn.Module) -> _FullyShard:
    """The state :func:`fully_shard` attached to ``module``."""
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
