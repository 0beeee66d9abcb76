"""Stage 3 over flat units: FSDP's design (Zhao et al. 2023, §3), the wrapper a model trains in.

Each unit's parameters become one flat vector, sharded over the data-parallel group
(:class:`~minipar.zero.flat.FlatStorage`); :class:`~minipar.zero.stage3.UnitSchedule` decides when
a unit is gathered, used, freed and reduced. The wrapper's parameters are this rank's fp32
shards (plus the parameters kept whole, :mod:`.persist`), so any element-wise optimizer steps
them: memory (4 + 4 + K)Ψ/N per rank in fp32, plus the gathered units in flight.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .flat import FlatStorage
from .persist import compute_in_fp32, persistent_parameters
from .stage3 import UnitSchedule, unit_parameters


class FullyShardedDataParallel(nn.Module):
    """``FullyShardedDataParallel(module, group=None, units=None, prefetch=True, param_dtype=None,
    persist_below=None, persist=None, reshard_after_forward=True, ignored_params=())``: stage 3
    over flat units (``ignored_params``: left to another state, :func:`unit_parameters`).

    ``units``: the modules gathered one at a time (default ``module.layers()``, else the
    whole module); every parameter must belong to exactly one unit. ``persist_below`` (elements)
    and ``persist`` (a predicate on modules): parameters kept whole (:func:`persistent_parameters`).
    ``group``: the data-parallel group (None = world). The wrapper's ``parameters()`` are this
    rank's fp32 shards: give them to any element-wise optimizer. ``gather_full_params()``
    returns the full parameters by their original names (call it on every rank).
    ``peak_gathered_bytes``: the most bytes of gathered units alive at once so far."""

    def __init__(self, module: nn.Module, group=None, units=None, prefetch: bool = True, param_dtype=None,
                 persist_below: int | None = None, persist=None, reshard_after_forward: bool = True,
                 ignored_params=()):
        super().__init__()
        object.__setattr__(self, "module", module)        # not a child: its params are not ours
        found = unit_parameters(module, units, ignored_params)
        whole = persistent_parameters(module, persist_below, persist, param_dtype)
        kept = {id(p) for p in whole}
        storage = FlatStorage([(m, [p for p, _ in f.values() if id(p) not in kept]) for m, f in found],
                              group, param_dtype or torch.float32)
        self.shards = nn.ParameterList([u.shard for u in storage.units])
        self.persistent = nn.ParameterList(whole)           # the module's own, replicated
        self.schedule = UnitSchedule(storage, module, group, prefetch, whole,
                                 reshard_after_forward=reshard_after_forward)
        compute_in_fp32(module, whole, param_dtype)

    units = property(lambda self: self.schedule.units)
    peak_gathered_bytes = property(lambda self: self.schedule.peak_gathered_bytes)
    peak_held_grad_bytes = property(lambda self: self.schedule.peak_held_grad_bytes)
    peak_state_bytes = property(lambda self: self.schedule.peak_state_bytes)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    def start_forward(self) -> None:
        self.schedule.start_forward()

    def finish_step(self) -> None:
        self.schedule.finish_step()

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        return self.schedule.gather_full_params()

    def memory_tensors(self, optimizer=None) -> dict[str, list[torch.Tensor]]:
        return self.schedule.memory_tensors(optimizer)

    def unit_sizes(self) -> list[int]:
        """Ψ_u of every unit (unpadded)."""
        return self.schedule.unit_sizes()

    def shard_spans(self) -> list[tuple]:
        return self.schedule.shard_spans()

    def persistent_numel(self) -> int:
        return self.schedule.persistent_numel()
