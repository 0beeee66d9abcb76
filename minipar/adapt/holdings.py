"""What one rank holds of the job's state under its layout, as global flat indices.

A rank's state is the checkpoint's pieces (:func:`minipar.pieces.local_pieces`):
every parameter and optimizer slot it holds, as boxes of the single-device tensor (a
tensor-parallel shard is a block of rows or columns, the fused ``[q; k; v]`` three) and flat
ranges inside them (ZeRO shards the flattened parameters: stage 1 the optimizer state, stage 3
the parameters too, each rank ``flat[r·k : (r+1)·k]``, :mod:`minipar.zero.flat`). A switch needs
the same description as a checkpoint; here each piece becomes the global flat indices of the
elements it holds, ``arange(full)[box].flatten()[lo:hi]``, under the key ``"<slot>/<name>"``
(``param/<name>``, ``exp_avg/<name>``, ...), with the live tensors it views, in the same order.

0-d state that every parameter shares (Adam's ``step``) is not moved: every rank holds it, and a
new layout's optimizer takes the old one's value (:func:`scalars`)."""
from __future__ import annotations

import math

import torch

from ..pieces import local_pieces


def _indices(piece) -> torch.Tensor:
    full = torch.arange(math.prod(piece.full_shape)).view(piece.full_shape)
    box = full[tuple(slice(o, o + s) for o, s in zip(piece.offset, piece.shape))]
    return box.reshape(-1)[piece.lo:piece.hi]


def holdings(hm, create: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """``(index, views)`` of this rank of the :class:`~minipar.hybrid.HybridModel` ``hm``: per key,
    the global flat indices it holds and the live 1-D tensors holding them (end to end in index
    order). ``create`` (``{name: {slot: (scalar?, dtype)}}``) makes optimizer state a fresh
    optimizer does not have yet, so that it can be written before its first step."""
    index, views = {}, {}
    for q in local_pieces(hm, hm.optimizer, create):
        if not q.full_shape:               # a 0-d slot (step): shared, not moved
            continue
        key = f"{q.key}/{q.name}"
        index.setdefault(key, []).append(_indices(q))
        views.setdefault(key, []).append(q.data)
    return {k: torch.cat(v) for k, v in index.items()}, views


def scalars(hm) -> dict[str, torch.Tensor]:
    """The 0-d optimizer state of this rank, by slot (the same for every parameter: ``step``)."""
    return {q.key: q.data for q in local_pieces(hm, hm.optimizer) if not q.full_shape}


def set_scalars(hm, values: dict[str, torch.Tensor]) -> None:
    """Give every 0-d optimizer slot of ``hm`` the value of ``values``."""
    for q in local_pieces(hm, hm.optimizer):
        if not q.full_shape and q.key in values:
            q.data.copy_(values[q.key].reshape(q.data.shape))

