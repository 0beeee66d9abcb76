"""ZeRO stage 3, P_os+g+p: parameters sharded too, gathered one unit at a time.

Rajbhandari et al. 2020, §5.3; the same design as PyTorch's FSDP (Zhao et al. 2023). Each
rank keeps only its shard of every unit's (layer's) flat parameters; a unit's full
parameters exist only while it computes:

* forward: all-gather a unit's shards just before it runs (:func:`gather_unit`), free the
  buffer right after (:func:`free_unit`); the next unit's gather starts first,
  asynchronously, to overlap this unit's compute (prefetch);
* backward: when the gradient of a unit's output arrives, gather it again (prefetching the
  unit before it); once all its gradients are in, reduce-scatter them (averaged) into this
  rank's gradient shard and free both full buffers.

Memory per rank (2 + 2 + K)Ψ/N (fp32: (4 + 4 + K)Ψ/N) plus the gathered units in flight
(at most two with prefetch); communication 3Ψ per step: all-gather twice, reduce-scatter
once. Under mixed precision (``param_dtype=torch.bfloat16``) the shards stay fp32 (the
master weights: 4 + 4 + 8 = 16 bytes per element, the paper's 2 + 2 + 12); gathers,
gathered units, activations and the reduce-scatter are bf16. Freeing keeps the tensor and
resizes its storage to 0, so the parameters autograd saved see the re-gathered values.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import trace
from ..comm import all_gather
from .flat import FlatUnit
from .memory import state_tensors
from .persist import Persistent, persistent_parameters
from .reduce import OrderedReduction, reduce_unit_grads


def gather_unit(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, **labels):
    """Gather-before-use: give ``full`` (flat, N·k elements, its storage possibly freed)
    its storage back and fill it with every rank's ``shard`` (k elements, cast to
    ``full``'s dtype) in rank order. Returns the all-gather's Handle if ``async_op``."""
    # >>> ex06 C
    full.untyped_storage().resize_(full.numel() * full.element_size())
    return all_gather(full, shard.detach().to(full.dtype), group=group, async_op=async_op, **labels)
    # <<< ex06 C


def free_unit(full: torch.Tensor) -> None:
    """Free-after-use: release ``full``'s memory but keep the tensor (and the parameter
    views into it) so the same buffer can be gathered into again."""
    # >>> ex06 C
    full.untyped_storage().resize_(0)
    # <<< ex06 C


class _Unit:
    def __init__(self, module, params, group, dtype):
        self.module, self.flat = module, FlatUnit(params, group)
        master = self.flat.flatten(params)
        self.shard = nn.Parameter(self.flat.shard_of(master).clone())   # fp32, k elements
        self.full = torch.empty(self.flat.padded, dtype=dtype, device=master.device)  # gathered buffer
        self.flat.use(self.full)
        free_unit(self.full)
        self.handle, self.gathered, self.t0, self.bw = None, False, 0.0, False


class Schedule(Persistent):
    """Stage 3's schedule, the same for both designs (this flat one and
    :mod:`minipar.zero.per_parameter`): gather a unit before its forward (prefetching the
    next), free it after; gather it again when its output's gradient arrives (prefetching the
    one before it in forward order); :class:`OrderedReduction` reduces its gradients. A design
    gives ``units`` (each with ``full``, ``gathered``, ``bw``, ``t0``), ``_order``,
    ``prefetch``, ``reduction``, ``_gather(i, wait=True, **labels)`` and ``_reduce(i)``;
    ``_use(i, gathered)`` switches what the unit's module computes with."""

    def _use(self, i: int, gathered: bool) -> None:
        pass                                               # the flat design's views never move

    def _free(self, i: int) -> None:
        u = self.units[i]
        if u.gathered:
            self._gather(i)                # already gathered: waits for its gather if in flight
            free_unit(u.full)
            u.gathered = False

    def _pre_forward(self, i: int) -> None:
        self._gather(i, phase="forward")
        self._order.append(i)
        self._use(i, True)
        if self.prefetch and i + 1 < len(self.units):
            self._gather(i + 1, wait=False, phase="forward", prefetch=True)
        self.units[i].t0 = trace.now()

    def _post_forward(self, i: int, out):
        trace.record("compute", "forward", self.units[i].t0, trace.now(), unit=i)
        self._use(i, False)
        self._free(i)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g, i=i: self._pre_backward(i))
        return out

    def _pre_backward(self, i: int) -> None:
        if self.units[i].bw:                               # one hook per output tensor
            return
        self.units[i].bw = True
        self.reduction.reached(i)
        self._gather(i, phase="backward")
        pos = self._order.index(i) if i in self._order else 0
        if self.prefetch and pos > 0:
            self._gather(self._order[pos - 1], wait=False, phase="backward", prefetch=True)
        self.units[i].t0 = trace.now()

class FullyShardedDataParallel(Schedule, nn.Module):
    """``FullyShardedDataParallel(module, group=None, units=None, prefetch=True, param_dtype=None,
    persist_below=None, persist=None)``.

    ``units``: the modules gathered one at a time (default ``module.layers()``, else the
    whole module); every parameter must belong to exactly one unit. ``persist_below`` (elements)
    and ``persist`` (a predicate on modules): parameters kept whole (:func:`persistent_parameters`). ``group``: the
    data-parallel group (None = world). The wrapper's ``parameters()`` are this rank's fp32
    shards: give them to any element-wise optimizer. ``gather_full_params()`` returns the
    full parameters by their original names (call it on every rank).
    ``peak_gathered_bytes``: the most bytes of gathered units alive at once so far."""

    def __init__(self, module: nn.Module, group=None, units=None, prefetch: bool = True, param_dtype=None,
                 persist_below: int | None = None, persist=None):
        super().__init__()
        object.__setattr__(self, "module", module)        # not a child: its params are not ours
        self.group, self.prefetch = group, prefetch
        self.param_dtype = param_dtype or torch.float32
        units = list(units if units is not None else
                     (module.layers() if hasattr(module, "layers") else [module]))
        owner = {}
        for i, m in enumerate(units):
            for p in m.parameters():
                if owner.setdefault(id(p), i) != i:
                    raise ValueError("a parameter is shared by two units (tied weights?); "
                                     "stage 3 needs each parameter in exactly one unit")
        missing = [n for n, p in module.named_parameters() if id(p) not in owner]
        if missing:
            raise ValueError(f"parameters in no unit: {missing[:3]}...; pass units= covering them")
        whole = persistent_parameters(module, persist_below, persist, param_dtype)
        kept = {id(p) for p in whole}
        sharded = [(m, [p for p in m.parameters() if p.requires_grad and id(p) not in kept]) for m in units]
        self.units = [_Unit(m, ps, group, self.param_dtype) for m, ps in sharded if ps]
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self.persistent = nn.ParameterList(whole)           # the module's own, replicated
        self._order: list[int] = []                        # units in forward order, this step
        self.peak_gathered_bytes = 0                       # most bytes of gathered units at once
        self._in_backward = False
        # backward completes the units in reverse forward order; reduce them in that order
        self.reduction = OrderedReduction([u.flat for u in self.units],
                                          lambda: list(reversed(self._order)), self._reduce,
                                          tail=self._reduce_persistent)
        self._watch_persistent()
        for i, u in enumerate(self.units):
            u.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            u.module.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))
            for p in u.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.reduction.grad_ready(i, p))

    def forward(self, *args, **kwargs):
        self._order = []
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    def _gather(self, i: int, wait: bool = True, **labels) -> None:
        u = self.units[i]
        if not u.gathered:
            u.handle = gather_unit(u.full, u.shard, self.group, async_op=True, unit=i, **labels)
            u.gathered = True
            in_flight = sum(v.full.untyped_storage().nbytes() for v in self.units)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, in_flight)
        if wait and u.handle is not None:
            u.handle.wait()
            u.handle = None

    def _pre_backward(self, i: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        super()._pre_backward(i)

    def _reduce(self, i: int) -> None:
        """Reduce-scatter unit i's gradients (mean) into its shard's .grad (accumulating, fp32);
        free the unit. Its next backward gathers it again (``bw`` is per backward)."""
        u = self.units[i]
        trace.record("compute", "backward", u.t0, trace.now(), unit=i)
        self._free(i)
        g = reduce_unit_grads(u.flat, dtype=self.param_dtype, unit=i).to(torch.float32)
        u.shard.grad = g if u.shard.grad is None else u.shard.grad.add_(g)
        u.bw = False

    def _end_backward(self) -> None:
        for i in range(len(self.units)):
            self._free(i)
        self._in_backward = False

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 parameters by the wrapped module's names (a collective: every rank
        calls it; every rank gets the whole dict)."""
        where = {}
        for u in self.units:
            full = torch.empty(u.flat.padded, device=u.shard.device)
            all_gather(full, u.shard.detach(), group=self.group, name="gather_full_params")
            for p, v in zip(u.flat.params, u.flat.views(full)):
                where[id(p)] = v.clone()
        where.update({id(p): p.detach().clone() for p in self.persistent})
        return {n: where[id(p)] for n, p in self.module.named_parameters() if id(p) in where}

    def memory_tensors(self, optimizer=None) -> dict[str, list[torch.Tensor]]:
        """Shards, any gathered buffers and the persistent parameters (params), gradient shards
        and persistent gradients, optimizer state."""
        return {"params": [u.shard for u in self.units] + [u.full for u in self.units] + list(self.persistent),
                "grads": [u.shard.grad for u in self.units]
                + [p.grad for u in self.units for p in u.flat.params] + [p.grad for p in self.persistent],
                "optimizer": state_tensors(optimizer) if optimizer is not None else []}

    def unit_sizes(self) -> list[int]:
        return [u.flat.numel for u in self.units]
