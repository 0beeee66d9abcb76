"""A plan of moves cut at the pieces of the live state, so that a switch reads and writes them.

:func:`minipar.moves.expand` gives positions in flat buffers laid end to end from a rank's pieces
(each key's 1-D views in order). :func:`by_piece` cuts every move where a piece of this rank ends
and makes its positions relative to that piece; :class:`Views` hands the pieces themselves to
:func:`minipar.moves.execute`, so the switch packs its send buffer from the old pieces, unpacks
into the new ones and copies what it keeps piece to piece: no flat copy of the whole state, old
or new. Only for the library's own ``execute`` (an exercise's gets its contract's positions)."""
from __future__ import annotations

import bisect

import numpy as np
import torch

from ..moves import Block, Flat, Move, Plan


class Views:
    """Tensors by piece for a plan cut at piece boundaries (:func:`by_piece`): a move keyed
    ``(old piece, new piece)`` reads ``views[key[side]]`` (``side`` 0: the old pieces, 1: the new
    ones), wrapped in :class:`Flat`; no flat copy of the whole state is made."""

    def __init__(self, views: list[torch.Tensor], side: int, device=None):
        self.views, self.side, self.flats = views, side, [Flat(v) for v in views]
        self.empty = [torch.empty(0, dtype=torch.float32, device=device)]

    def __getitem__(self, key) -> Flat:
        return self.flats[key[self.side]]

    def values(self) -> list[torch.Tensor]:
        return self.views or self.empty

def by_piece(p: Plan, me: int, old_sizes: list[int], new_sizes: list[int]) -> Plan:
    """Rank ``me``'s moves of ``p`` (positions in flat buffers laid end to end from pieces of
    ``old_sizes`` and ``new_sizes`` elements) cut where a piece of ``me`` ends, each position then
    relative to its piece, the key ``(old piece, new piece)`` (0 on the side another rank holds:
    never read). In order, so that what a rank packs is what its peer unpacks: each side cuts
    only its own pieces, and the elements of a move keep their order. With :class:`Views`, the
    moves read and write the live pieces themselves."""
    ob = np.concatenate([[0], np.cumsum(old_sizes, dtype=np.int64)]).astype(np.int64)
    nb = np.concatenate([[0], np.cumsum(new_sizes, dtype=np.int64)]).astype(np.int64)
    far = np.array([0, np.iinfo(np.int64).max], np.int64)          # one piece: the other rank's side
    lists = {id(b): b.tolist() for b in (ob, nb, far)}
    out = Plan(p.world_size)
    for mv in p.moves:
        if me not in (mv.src, mv.dst):
            continue
        bx, by = (ob if mv.src == me else far), (nb if mv.dst == me else far)
        out.moves += [Move(mv.src, mv.dst, (i, j), x, y) for i, j, x, y in _cut(mv.src_pos, mv.dst_pos, bx, by,
                                                                                     (lists[id(bx)], lists[id(by)]))]
    return out


def _piece(bounds: np.ndarray, at: np.ndarray) -> np.ndarray:
    return np.searchsorted(bounds, at, side="right") - 1


def _cut(x, y, bx: np.ndarray, by: np.ndarray, lists: tuple[list, list]) -> list[tuple]:
    """Positions ``x → y`` cut where a piece (``bx``, ``by``: their bounds; ``lists``: the same as lists) ends on either side:
    ``[(old piece, new piece, x', y')]`` in order, positions relative to their pieces."""
    if isinstance(x, slice):                 # a walk along both sides' bounds, in plain ints
        x0, y0, n, lx, ly = x.start, y.start, x.stop - x.start, *lists
        i, j, u, out = bisect.bisect_right(lx, x0) - 1, bisect.bisect_right(ly, y0) - 1, 0, []
        while u < n:
            while lx[i + 1] <= x0 + u:      # past a piece's end (empty pieces too)
                i += 1
            while ly[j + 1] <= y0 + u:
                j += 1
            v = min(n, lx[i + 1] - x0, ly[j + 1] - y0)
            out.append((i, j, slice(x0 + u - lx[i], x0 + v - lx[i]), slice(y0 + u - ly[j], y0 + v - ly[j])))
            u = v
        return out
    if isinstance(x, Block):
        rows = np.arange(x.count, dtype=np.int64)
        xs, ys = x.start + rows * x.stride, y.start + rows * y.stride
        i, j = _piece(bx, xs), _piece(by, ys)
        if not ((xs + x.length <= bx[i + 1]).all() and (ys + y.length <= by[j + 1]).all()):
            return [c for r in range(x.count) for c in _cut(slice(int(xs[r]), int(xs[r]) + x.length),
                                                            slice(int(ys[r]), int(ys[r]) + y.length), bx, by, lists)]
        first = np.flatnonzero(np.concatenate([[True], (i[1:] != i[:-1]) | (j[1:] != j[:-1])])).tolist()
        out = []
        for u, v in zip(first, first[1:] + [x.count]):
            a, b = int(i[u]), int(j[u])
            out.append((a, b, Block(int(xs[u] - bx[a]), x.stride, v - u, x.length),
                        Block(int(ys[u] - by[b]), y.stride, v - u, y.length)))
        return out
    xn, yn = x.numpy(), y.numpy()
    i, j = _piece(bx, xn), _piece(by, yn)
    if len(xn) == 0:
        return []
    first = np.flatnonzero(np.concatenate([[True], (i[1:] != i[:-1]) | (j[1:] != j[:-1])])).tolist()
    out = []
    for u, v in zip(first, first[1:] + [len(xn)]):
        a, b = int(i[u]), int(j[u])
        out.append((a, b, torch.from_numpy(xn[u:v] - bx[a]), torch.from_numpy(yn[u:v] - by[b])))
    return out
