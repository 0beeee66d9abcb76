"""Flat, padded, sharded parameters: the layout every ZeRO stage shares.

A *unit* (a layer, or the whole model) is a list of parameters. Its Ψ_u elements are laid
end to end in one flat vector, zero-padded to a multiple of the data-parallel degree N
(collectives need equal sizes), so that every rank owns an equal, contiguous shard of

    k_u = ⌈Ψ_u / N⌉ elements:  rank r owns flat[r·k_u : (r+1)·k_u]

The padding (at most N-1 elements per unit) stays zero under SGD and Adam(W). The parameters
become *views* into the flat vector: the model runs unchanged while the strategies move
whole flat vectors with one collective.

Stage 3 keeps only the shard and gives the flat vector its memory only while the unit
computes (:func:`gather_unit`, :func:`free_unit`): :class:`FlatStorage` is that storage,
FSDP's flat parameters, for :class:`minipar.zero.stage3.UnitSchedule`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import all_gather, group_rank, group_size
from .reduce import reduce_unit_grads


def shard_size(numel: int, n: int) -> int:
    """k = ⌈numel / n⌉, the elements each of ``n`` ranks owns after padding."""
    return -(-numel // n)


def padded_size(numel: int, n: int) -> int:
    """numel rounded up to a multiple of ``n`` (= n·k)."""
    return shard_size(numel, n) * n


class FlatUnit:
    """One unit's parameters as a flat vector padded to N·k elements, and this rank's shard.

    ``params``: the unit's parameters (each appears once). ``group``: the data-parallel
    group (None = world). Nothing is allocated here; the stages decide what to keep."""

    def __init__(self, params, group=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("a unit needs at least one parameter")
        self.group = group
        self.n, self.rank = group_size(group), group_rank(group)
        self.numels = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)                      # Ψ_u
        self.k = shard_size(self.numel, self.n)            # shard elements per rank
        self.padded = self.k * self.n                      # N·k

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """A new flat padded vector holding ``tensors`` (shaped like the parameters)."""
        dtype = dtype or self.params[0].dtype
        flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        for t, o, m in zip(tensors, self.offsets, self.numels):
            flat[o:o + m].copy_(t.detach().reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters' shapes as views into ``flat`` (no copy)."""
        return [flat[o:o + m].view(s) for o, m, s in zip(self.offsets, self.numels, self.shapes)]

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's k elements of ``flat`` (a view)."""
        return flat[self.rank * self.k:(self.rank + 1) * self.k]

    def use(self, flat: torch.Tensor) -> None:
        """Point every parameter's data at its view of ``flat``."""
        for p, v in zip(self.params, self.views(flat)):
            p.data = v

    def shard_spans(self) -> list[tuple[torch.nn.Parameter, int, int, int]]:
        """The parameters this rank's shard overlaps, as ``(param, a, b, s)``: elements [a, b)
        of the flattened parameter are elements [s, s + b - a) of the shard (padding left out)."""
        lo, hi, out = self.rank * self.k, (self.rank + 1) * self.k, []
        for p, o, m in zip(self.params, self.offsets, self.numels):
            a, b = max(lo, o), min(hi, o + m)
            if a < b:
                out.append((p, a - o, b - o, a - lo))
        return out


def split_units(model_or_params, units=None) -> list[list[torch.nn.Parameter]]:
    """The units to shard: ``units`` (lists of parameters or modules) if given, else the
    model's ``layers()`` if it has them, else all parameters as one unit. Parameters that
    belong to no unit (or are shared between units) go to the first unit that holds them;
    leftovers form a last unit. Only parameters that require a gradient are sharded."""
    if isinstance(model_or_params, torch.nn.Module):
        model, everything = model_or_params, list(model_or_params.parameters())
        if units is None:
            units = model.layers() if hasattr(model, "layers") else [model]
    else:
        everything = list(model_or_params)
        if everything and not isinstance(everything[0], torch.Tensor):   # already a list of units
            units = [list(u.parameters() if isinstance(u, torch.nn.Module) else u) for u in everything]
            everything = [p for u in units for p in u]
        elif units is None:
            units = [everything]
    seen, out = set(), []
    for u in units:
        ps = u.parameters() if isinstance(u, torch.nn.Module) else u
        keep = [p for p in ps if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in keep)
        if keep:
            out.append(keep)
    rest = [p for p in everything if p.requires_grad and id(p) not in seen]
    if rest:
        out.append(list({id(p): p for p in rest}.values()))
    return out


# ----------------------------------------------------------------- stage 3's flat storage
# Contract:
# ex06.C.gather: afterwards ``full`` (N·k elements) holds every rank's ``shard`` (k elements) in
#     rank order, in ``full``'s dtype, whether or not its memory was released by ``free_unit``;
#     every view into ``full`` sees the values.
# ex06.C.async: with ``async_op`` it returns the collective's Handle (its ``wait()`` completes
#     the gather), else None; ``**labels`` reach the collective.
def gather_unit(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, **labels):
    """Gather-before-use: give ``full`` (flat, N·k elements, its storage possibly freed)
    its storage back and fill it with every rank's ``shard`` (k elements, cast to
    ``full``'s dtype) in rank order. Returns the all-gather's Handle if ``async_op``."""
    # >>> ex06 C
    full.untyped_storage().resize_(full.numel() * full.element_size())
    return all_gather(full, shard.detach().to(full.dtype), group=group, async_op=async_op, **labels)
    # <<< ex06 C


# Contract:
# ex06.C.free: afterwards ``full`` holds no memory (its storage 0 bytes) while the tensor, its
#     shape and every view into it (the model's parameters) stay, ready for the next gather.
def free_unit(full: torch.Tensor) -> None:
    """Free-after-use: release ``full``'s memory but keep the tensor (and the parameter
    views into it) so the same buffer can be gathered into again."""
    # >>> ex06 C
    full.untyped_storage().resize_(0)
    # <<< ex06 C


class ShardedFlatUnit:
    """A unit under stage 3: its fp32 ``shard`` (k elements, what the optimizer steps) and the
    ``full`` buffer of N·k elements the parameters are views of, its storage freed until gathered."""

    # Contract:
    # ex06.C.shard: ``self.module``, ``self.flat`` (the unit's ``FlatUnit``) and ``self.params``
    #     are set; ``self.shard`` is a leaf fp32 Parameter, this rank's k elements of the unit's
    #     flattened parameters.
    # ex06.C.full: ``self.full`` is a buffer of N·k elements in ``dtype`` that the parameters are
    #     views of, holding no memory from the start.
    def __init__(self, module: nn.Module, params, group, dtype):
        # >>> ex06 C
        self.module, self.flat = module, FlatUnit(params, group)
        self.params = self.flat.params                     # what the gradients arrive on
        master = self.flat.flatten(self.params)
        self.shard = nn.Parameter(self.flat.shard_of(master).clone())
        self.full = torch.empty(self.flat.padded, dtype=dtype, device=master.device)
        self.flat.use(self.full)
        free_unit(self.full)
        # <<< ex06 C


class FlatStorage:
    """Stage 3's storage in flat units (:class:`minipar.zero.stage3.Storage`): ``units`` is
    ``[(module, params)]`` (a unit without parameters is dropped), ``dtype`` that of the
    gathered buffers and of the gradients' reduce-scatter. The parameters are views of the
    buffers all along, so :meth:`use` has nothing to do; a freed unit keeps its tensors and
    views (those autograd saved too), which see the values gathered next."""

    def __init__(self, units, group=None, dtype=torch.float32):
        self.group, self.dtype = group, dtype
        self.units = [ShardedFlatUnit(m, ps, group, dtype) for m, ps in units if ps]

    # Contract:
    # ex06.C.storage: ``gather(i, **labels)`` starts unit i's gather and returns its Handle;
    #     ``free(i)`` releases unit i's buffer (as ex06.C.free).
    # ex06.C.reduce: ``reduce(i)`` adds this rank's slice of the mean gradient of unit i, reduced
    #     in ``self.dtype`` and held in fp32, to the shard's ``.grad``.
    # ex06.C.accumulate: a second backward before the step accumulates into the shard's
    #     ``.grad``.
    def gather(self, i: int, **labels):
        # >>> ex06 C
        u = self.units[i]
        return gather_unit(u.full, u.shard, self.group, async_op=True, **labels)
        # <<< ex06 C

    def use(self, i: int, gathered: bool) -> None:
        pass

    def free(self, i: int) -> None:
        # >>> ex06 C
        free_unit(self.units[i].full)
        # <<< ex06 C

    def reduce(self, i: int) -> None:
        # >>> ex06 C
        u = self.units[i]
        g = reduce_unit_grads(u.flat, dtype=self.dtype, unit=i).to(torch.float32)
        u.shard.grad = g if u.shard.grad is None else u.shard.grad.add_(g)
        # <<< ex06 C

    @torch.no_grad()
    def full_params(self) -> dict[int, torch.Tensor]:
        """``{id(parameter): its full fp32 value}`` (a collective: every rank calls it)."""
        where = {}
        for u in self.units:
            full = torch.empty(u.flat.padded, dtype=u.shard.dtype, device=u.shard.device)
            all_gather(full, u.shard.detach(), group=self.group, name="gather_full_params")
            where.update({id(p): v.clone() for p, v in zip(u.params, u.flat.views(full))})
        return where

    def shard_spans(self) -> list[tuple]:
        """``(parameter, shard, a, b, s)``: elements [a, b) of the flattened parameter are elements
        [s, s + b - a) of this rank's ``shard`` (what a checkpoint saves and loads in place)."""
        return [(p, u.shard, a, b, s) for u in self.units for p, a, b, s in u.flat.shard_spans()]

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Shards and gathered buffers; the shards' and the parameters' gradients."""
        return {"params": [u.shard for u in self.units] + [u.full for u in self.units],
                "grads": [u.shard.grad for u in self.units] + [p.grad for u in self.units for p in u.params]}

    def unit_sizes(self) -> list[int]:
        """Ψ_u of every unit (unpadded)."""
        return [u.flat.numel for u in self.units]
