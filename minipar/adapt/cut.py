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

from .. import comm
from ..moves import Block, Flat, Move, Plan
from ..runtime import trace


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


_STAGING: dict = {}     # device -> the flat fp32 buffer every switch packs into and receives in


def staging(numel: int, device) -> torch.Tensor:
    """A flat fp32 buffer of at least ``numel`` elements, kept for the next switch on a CPU: a fresh
    buffer's pages are first touched by the copy into it (there several times the cost of the
    copy itself: 26 MB took 40-55 ms fresh, 1.4-2.8 ms warm, on the course's 2-core machine); a
    kept one's are not. It grows to the largest switch's send and receive bytes and stays
    (:func:`release` frees it). On a GPU a fresh one each time: the caching allocator already
    keeps freed blocks, and a GPU's memory is the scarcer."""
    if torch.device(device if device is not None else "cpu").type != "cpu":
        return torch.empty(numel, dtype=torch.float32, device=device)
    device = torch.device("cpu")
    buf = _STAGING.get(device)
    if buf is None or buf.numel() < numel:
        _STAGING[device] = buf = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


def release() -> None:
    """Free the staging buffers (:func:`staging`)."""
    _STAGING.clear()


def _view(flat: torch.Tensor, pos):
    """``flat``'s elements at ``pos`` as a view (a slice, a :class:`Block`'s rows), or ``None`` for
    an index (a gather)."""
    if isinstance(pos, slice):
        return flat[pos]
    if isinstance(pos, Block):
        return pos.of(flat)
    return None


def _read(flat: torch.Tensor, pos, out: torch.Tensor) -> None:
    """``out`` (contiguous, ``numel`` of ``pos``) = ``flat``'s elements at ``pos``, one copy."""
    v = _view(flat, pos)
    if v is None:
        torch.index_select(flat, 0, pos, out=out)
    else:
        out.view(v.shape).copy_(v)


def _write(flat: torch.Tensor, pos, values: torch.Tensor) -> None:
    """``flat``'s elements at ``pos`` = ``values`` (contiguous), one copy."""
    v = _view(flat, pos)
    if v is None:
        flat.index_copy_(0, pos, values)
    else:
        v.copy_(values.view(v.shape))


def runs(moves: list[Move], side: int) -> list[tuple]:
    """One side's positions of ``moves`` (``side`` 0: what this rank packs, read at ``src_pos``; 1:
    what it unpacks, written at ``dst_pos``) as ``[(piece, position, numel)]`` in the same order,
    with consecutive slices of one piece merged: adjacent ones into one slice, ones of one length
    at one stride into a :class:`Block` (a tensor-parallel shard's rows, sent as many moves, read
    as one strided copy). The buffer between the two sides is contiguous, so only this side's
    regularity matters."""
    out, run = [], None                    # run: [piece, start, length, count, stride]

    def flush():
        if run is not None:
            k, a, n, c, st = run
            pos = slice(a, a + n) if c == 1 else slice(a, a + c * n) if st == n else Block(a, st, c, n)
            out.append((k, pos, n * c))
    for mv in moves:
        k, pos = mv.key[side], (mv.src_pos, mv.dst_pos)[side]
        if not isinstance(pos, slice):
            flush()
            run = None
            out.append((k, pos, mv.numel))
            continue
        a, n = pos.start, pos.stop - pos.start
        if n == 0:
            continue
        if run is not None and run[0] == k:
            _, a0, n0, c, st = run
            if c == 1 and a == a0 + n0:                         # adjacent: one longer slice
                run[2] += n
                continue
            if n == n0 and ((c == 1 and a - a0 > n0) or (c > 1 and a == a0 + c * st)):   # one more row
                run[3], run[4] = c + 1, (a - a0 if c == 1 else st)
                continue
        flush()
        run = [k, a, n, 1, n]
    flush()
    return out


def splits(p: Plan, me: int) -> tuple[list[int], list[int]]:
    """Rank ``me``'s all-to-all of plan ``p``: the elements it sends to each rank and receives from
    each (0 for itself): the split sizes of its ``all_to_all_single``."""
    send, recv = [0] * p.world_size, [0] * p.world_size
    for mv in p.moves:
        if mv.src != mv.dst:
            if mv.src == me:
                send[mv.dst] += mv.numel
            if mv.dst == me:
                recv[mv.src] += mv.numel
    return send, recv


_PROGRAMS: dict = {}     # id(plan) -> (plan, local moves, runs to pack, runs to unpack, split sizes)


def exchange(p: Plan, old: Views, new: Views, group=None, name: str = "reshard") -> int:
    """:func:`minipar.moves.execute` of a plan cut at the pieces (:func:`by_piece`), each element
    copied once on each side: the sent ones packed straight from the old pieces into one send
    buffer, one ``all_to_all_single`` (its event named ``name``), during which the local moves
    are copied piece to piece, then the received ones unpacked straight into the new pieces
    (packing and unpacking as :func:`runs`, made once per plan); a :class:`Block` is copied as a
    strided view (no temporary), the send and receive buffers are one kept :func:`staging`
    buffer. The same elements in the same order as ``execute``; returns the bytes this rank's
    all-to-all event recorded as sent."""
    me, world = comm.group_rank(group), p.world_size
    dtypes = {v.dtype for v in (*old.values(), *new.values())}
    if dtypes - {torch.float32}:
        raise NotImplementedError(f"a live switch moves fp32 state, got {sorted(map(str, dtypes))}")
    kept = _PROGRAMS.get(id(p))
    if kept is None or kept[0] is not p:
        pairs = {}
        for mv in p.moves:                                     # the moves by (src, dst), in plan order
            pairs.setdefault((mv.src, mv.dst), []).append(mv)
        out_moves = [mv for d in range(world) if d != me for mv in pairs.get((me, d), [])]
        in_moves = [mv for s in range(world) if s != me for mv in pairs.get((s, me), [])]
        in_sizes, out_sizes = splits(p, me)
        kept = _PROGRAMS[id(p)] = (p, pairs.get((me, me), []), runs(out_moves, 0), runs(in_moves, 1),
                                   in_sizes, out_sizes)
        while len(_PROGRAMS) > 32:
            del _PROGRAMS[next(iter(_PROGRAMS))]
    _, local, pack, unpack, in_sizes, out_sizes = kept
    device = old.values()[0].device
    buf = staging(sum(in_sizes) + sum(out_sizes), device)
    send, recv = buf[:sum(in_sizes)], buf[sum(in_sizes):]
    at = 0
    for k, pos, n in pack:
        _read(old.views[k], pos, send[at:at + n])
        at += n
    with trace.recording(True):            # observed even where a run records nothing else
        mark = trace.mark()
        handle = comm.all_to_all_single(recv, send, out_sizes, in_sizes, group=group, name=name, async_op=True)
        for mv in local:                   # what this rank keeps, copied while the exchange is in flight
            src, dst = old[mv.key].tensor, new[mv.key].tensor
            a, b = _view(src, mv.src_pos), _view(dst, mv.dst_pos)
            if a is not None and b is not None:
                b.copy_(a.reshape(b.shape) if a.shape != b.shape else a)
            else:
                _write(dst, mv.dst_pos, src[mv.src_pos] if a is None else a.reshape(-1))
        handle.wait()
        observed = sum(e["bytes_sent"] for e in trace.since(mark) if e["name"] == name)
    at = 0
    for k, pos, n in unpack:
        _write(new.views[k], pos, recv[at:at + n])
        at += n
    return observed
