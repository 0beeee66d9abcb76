"""Flat, padded, sharded parameters: the layout every ZeRO stage shares.

A *unit* (a layer, or the whole model) is a list of parameters. Its Ψ_u elements are laid
end to end in one flat vector, zero-padded to a multiple of the data-parallel degree N
(collectives need equal sizes), so that every rank owns an equal, contiguous shard of

    k_u = ⌈Ψ_u / N⌉ elements:  rank r owns flat[r·k_u : (r+1)·k_u]

The padding (at most N-1 elements per unit) stays zero under SGD and Adam(W). The parameters
become *views* into the flat vector: the model runs unchanged while the strategies move
whole flat vectors with one collective.
"""
from __future__ import annotations

import torch

from ..comm import group_rank, group_size


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
