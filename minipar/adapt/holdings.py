"""What one rank holds of the job's state under its layout, as global flat indices.

A rank's state is the checkpoint's pieces (:func:`minipar.pieces.local_pieces`):
every parameter and optimizer slot it holds, as boxes of the single-device tensor (a
tensor-parallel shard is a block of rows or columns, the fused ``[q; k; v]`` three) and flat
ranges inside them (ZeRO shards the flattened parameters: stage 1 the optimizer state, stage 3
the parameters too, each rank ``flat[r·k : (r+1)·k]``, :mod:`minipar.zero.flat`). A switch needs
the same description as a checkpoint; here each piece becomes the global flat indices of the
elements it holds, ``arange(full)[box].flatten()[lo:hi]``, under the key ``"<slot>/<name>"``
(``param/<name>``, ``exp_avg/<name>``, ...), with the live tensors it views, in the same order.

A switch never materialises those indices: :func:`held_runs` writes each piece as its runs of
consecutive global indices, ``[[start, length], ...]``, straight from the box and the flat range
(a row of a box is one run, rows that meet merge), a few numbers per tensor-parallel row, none
per element; :func:`holdings` expands them (for figures and tests).

0-d state that every parameter shares (Adam's ``step``) is not moved: every rank holds it, and a
new layout's optimizer takes the old one's value (:func:`scalars`)."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..pieces import local_pieces


def piece_runs(full_shape, offset, shape, lo: int, hi: int) -> np.ndarray:
    """The global flat indices of elements ``[lo, hi)`` of box ``(offset, shape)``'s row-major
    flattening, as runs ``[[start, length], ...]`` in that order: each row of the box (its last
    dimension) is ``full[o + i, ..., o_k : o_k + s_k]``, one run; rows that meet are merged."""
    full_shape, offset, shape = tuple(full_shape), tuple(offset), tuple(shape)
    if hi <= lo:
        return np.zeros((0, 2), np.int64)
    if shape[1:] == full_shape[1:]:        # whole rows (a replica, a row shard, a ZeRO range): one run
        return np.array([[offset[0] * math.prod(full_shape[1:]) + lo, hi - lo]], np.int64)
    strides = np.cumprod((1,) + full_shape[:0:-1])[::-1]          # row-major, in elements
    width = shape[-1]
    rows = np.indices(shape[:-1]).reshape(len(shape) - 1, -1)
    starts = (rows + np.array(offset[:-1]).reshape(-1, 1)).T @ strides[:-1] + offset[-1]
    first, last = lo // width, -(-hi // width)                      # the rows [lo, hi) touches
    starts = starts[first:last].astype(np.int64)
    lengths = np.full(len(starts), width, np.int64)
    starts[0] += lo - first * width
    lengths[0] -= lo - first * width
    lengths[-1] -= last * width - hi
    return merged(np.stack([starts, lengths], 1))


def merged(runs: np.ndarray, group: np.ndarray | None = None):
    """``runs`` with every run that starts where the one before ends joined to it; with ``group``
    (one label per run) only runs of the same group join, and the merged runs' groups come too."""
    new = np.ones(len(runs), bool)
    new[1:] = runs[1:, 0] != runs[:-1, 0] + runs[:-1, 1]
    if group is not None:
        new[1:] |= group[1:] != group[:-1]
    at = np.flatnonzero(new)
    out = np.stack([runs[at, 0], np.add.reduceat(runs[:, 1], at)], 1) if len(runs) else runs.reshape(-1, 2)
    return out if group is None else (out, group[at])


def held_runs(hm, create: dict | None = None, pieces=None):
    """``(held, views, shared)`` of this rank of the :class:`~minipar.hybrid.HybridModel` ``hm``.
    ``held`` is ``(keys, counts, runs)``: the keys it holds, how many runs each, and all the runs
    of global flat indices (:func:`piece_runs`) key after key, each key's in local order (what
    travels, as it is); ``views``: per key the live 1-D tensors holding them (end to end in that
    order); ``shared``: the 0-d optimizer state by slot, every parameter's (the same value:
    :func:`scalars`). ``create`` (``{name: {slot: (scalar?, dtype)}}``) makes optimizer state a
    fresh optimizer does not have yet, so that it can be written before its first step. The
    pieces' runs are merged and grouped by key in one vectorised pass. ``pieces``: the pieces
    themselves, if the caller has them (:func:`~minipar.pieces.local_pieces`)."""
    keys, views, shared, runs, of = {}, {}, {}, [], []
    for q in local_pieces(hm, hm.optimizer, create) if pieces is None else pieces:
        if not q.full_shape:               # a 0-d slot (step): shared, not moved
            shared.setdefault(q.key, []).append(q.data)
            continue
        key = f"{q.key}/{q.name}"
        r = piece_runs(q.full_shape, q.offset, q.shape, q.lo, q.hi)
        runs.append(r)
        of.append(np.full(len(r), keys.setdefault(key, len(keys))))
        views.setdefault(key, []).append(q.data)
    if not runs:
        return ([], np.zeros(0, np.int64), np.zeros((0, 2), np.int64)), views, shared
    of = np.concatenate(of)
    order = np.argsort(of, kind="stable")                # by key, each key's runs in local order
    runs, of = merged(np.concatenate(runs)[order], of[order])
    return (list(keys), np.bincount(of, minlength=len(keys)), runs), views, shared


def by_key(held) -> dict[str, np.ndarray]:
    """:func:`held_runs`' ``held`` as ``{key: runs}``."""
    keys, counts, runs = held
    return dict(zip(keys, np.split(runs, np.cumsum(counts)[:-1]))) if keys else {}


def holdings(hm, create: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """``(index, views)`` of this rank of the :class:`~minipar.hybrid.HybridModel` ``hm``: per key,
    the global flat indices it holds and the live 1-D tensors holding them (end to end in index
    order); ``create`` as :func:`held_runs`."""
    from .switch import from_runs   # deferred: switch imports this module (a real cycle)
    held, views, _ = held_runs(hm, create)
    return from_runs({k: torch.from_numpy(r) for k, r in by_key(held).items()}), views


def scalars(hm) -> dict[str, torch.Tensor]:
    """The 0-d optimizer state of this rank, by slot (the same for every parameter: ``step``)."""
    return {q.key: q.data for q in local_pieces(hm, hm.optimizer) if not q.full_shape}


def set_scalars(hm, values: dict[str, torch.Tensor]) -> None:
    """Give every 0-d optimizer slot of ``hm`` the value of ``values``."""
    for q in local_pieces(hm, hm.optimizer):
        if not q.full_shape and q.key in values:
            q.data.copy_(values[q.key].reshape(q.data.shape))

