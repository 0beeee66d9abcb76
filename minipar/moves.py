"""Moving state between two holdings of it: the plan of moves and its one all-to-all.

Chapter 04's re-partitioning (layers change pipeline rank) and chapter 12's live switch (a whole
new layout) move state the same way. A rank's *holding* says which elements of the state it
keeps: for every key (a parameter, ``param/<name>``, or a slot of its optimizer state,
``exp_avg/<name>``, ...) the global flat indices of the single-device tensor that its local tensor
holds, in local order (its tensor-parallel shard, its stage's layers, its ZeRO-1 slice). Two
holdings per rank, before and after; the plan gives every element of the new holdings one source:

    src(q, e) = q                     if rank q already holds e   (a local copy, no bytes)
              = the first holder r of e after q, in the ring order q+1, q+2, ...  (otherwise)

so a move never sends what a rank has, and the sources of one element spread over its
holders. The plan's bytes, Σ over moves with src ≠ dst of elements × element size, are what the
move must send and nothing more: :func:`execute` sends exactly these in one all-to-all (a test
counts them independently). An element that no rank holds is an error, never a zero.

Holdings travel and are planned as *runs* of consecutive indices, ``[[start, length], ...]``:
:func:`segments` cuts the index space where any run starts or ends (inside a segment every rank
holds all or none), :func:`plan` plans segments as it would elements, :func:`expand` turns that
into element positions for the ranks concerned, and :func:`move` does all of it for flat buffers
laid end to end in the holdings' order (:func:`minipar.adapt.switch.reshard`,
:func:`minipar.pipeline.adaptive.move_layers`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from . import comm
from .runtime import trace


@dataclass(frozen=True)
class Move:
    """``src``'s elements ``src_pos`` (local positions) of ``key`` become ``dst``'s ``dst_pos``: index
    tensors, or two slices of one length where both sides are one contiguous run (a copy, not a
    gather; :func:`expand` makes them)."""
    src: int
    dst: int
    key: str
    src_pos: torch.Tensor
    dst_pos: torch.Tensor | slice

    @cached_property                # a kept plan's moves are counted at every switch
    def numel(self) -> int:
        d = self.dst_pos
        if isinstance(d, slice):
            return d.stop - d.start
        return d.numel if isinstance(d, Block) else len(d)


@dataclass(frozen=True)
class Block:
    """``count`` runs of ``length`` elements of a flat tensor, the i-th from ``start + i·stride``:
    a strided view, copied at memory speed where an index gathers element by element (a
    tensor-parallel column shard's rows). Positions of the library's own switch (:class:`Flat`)."""
    start: int
    stride: int
    count: int
    length: int

    @property
    def numel(self) -> int:
        return self.count * self.length

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided((self.count, self.length), (self.stride, 1), flat.storage_offset() + self.start)


class Flat:
    """A flat tensor that :class:`Block` positions index too: ``flat[block]`` is its runs end to end,
    ``flat[block] = values`` writes them; any other position is the tensor's own indexing."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.dtype, self.device = tensor, tensor.dtype, tensor.device

    def __getitem__(self, pos):
        return pos.of(self.tensor).reshape(-1) if isinstance(pos, Block) else self.tensor[pos]

    def __setitem__(self, pos, value):
        if isinstance(pos, Block):
            pos.of(self.tensor).copy_(value.reshape(pos.count, pos.length))
        else:
            self.tensor[pos] = value



@dataclass
class Plan:
    world_size: int
    moves: list[Move] = field(default_factory=list)

    def sent(self, itemsize: dict[str, int] | int = 4) -> list[int]:
        """Bytes each rank sends (local copies cost nothing)."""
        out = [0] * self.world_size
        for mv in self.moves:
            if mv.src != mv.dst:
                out[mv.src] += mv.numel * (itemsize if isinstance(itemsize, int) else itemsize[mv.key])
        return out

    def bytes(self, itemsize: dict[str, int] | int = 4) -> int:
        """Σ of :meth:`sent`: the bytes the whole switch moves between ranks."""
        return sum(self.sent(itemsize))

    def between(self, src: int, dst: int) -> list[Move]:
        return [mv for mv in self.moves if mv.src == src and mv.dst == dst]


# Contract:
# Given: a rank's holding maps each key of the job's state to the global flat indices (int64) of
#     the single-device tensor its local tensor keeps, in local order; ``plan`` returns a
#     ``Plan`` of ``Move(src, dst, key, src_pos, dst_pos)``.
# ex12.A.once: every element of a new holding gets exactly one source.
# ex12.A.local: the source is the rank itself when it already holds the element (a local copy).
# ex12.A.ring: else the first holder after it in ring order (dst+1, dst+2, ... mod world).
# ex12.A.sorted: the moves come sorted by (dst, src), keys in ``sizes``' order within each pair.
# ex12.A.missing: an element held by no rank is a ``ValueError`` naming the key.
# ex12.A.world: old and new holdings of a different number of ranks are a ``ValueError``.
# ex12.A.bytes: the plan's bytes (``Plan.sent``, the library's) are then exactly the elements
#     missing at their destination, each at its key's itemsize.
def plan(old: list[dict[str, torch.Tensor]], new: list[dict[str, torch.Tensor]],
         sizes: dict[str, int]) -> Plan:
    """The plan from the ranks' ``old`` holdings to their ``new`` ones (lists by global rank;
    ``sizes[key]``: the single-device tensor's number of elements). Moves come in (dst, src) order,
    keys in ``sizes``' order within each pair: the order every rank packs and unpacks them in."""
    # >>> ex12 A
    world = len(old)
    if len(new) != world:
        raise ValueError(f"{len(old)} old holdings but {len(new)} new ones: a switch keeps the world size")
    out = Plan(world)
    for key, n in sizes.items():
        where = torch.full((world, n), -1, dtype=torch.int32)      # where[r, e]: r's local position of e
        for r, h in enumerate(old):
            if key in h:
                where[r, h[key]] = torch.arange(len(h[key]), dtype=torch.int32)
        for q, h in enumerate(new):
            if key not in h:
                continue
            need = h[key]
            pos = torch.arange(len(need))
            mine = where[q, need]
            kept = mine >= 0                                               # a local copy
            if bool(kept.any()):
                out.moves.append(Move(q, q, key, mine[kept].long(), pos[kept]))
            rest, at = need[~kept], pos[~kept]
            if len(rest) == 0:
                continue
            src = torch.full((len(rest),), -1, dtype=torch.long)
            spos = torch.full((len(rest),), -1, dtype=torch.long)
            for r in [(q + j) % world for j in range(1, world)]:            # the first holder after q
                at_r = where[r, rest]
                take = (src < 0) & (at_r >= 0)
                src[take], spos[take] = r, at_r[take].long()
            if bool((src < 0).any()):
                lost = rest[src < 0]
                raise ValueError(f"{key}: elements {lost[:4].tolist()} (of {len(lost)}) are held by no rank "
                                 f"of the old layout")
            for r in range(world):
                mask = src == r
                if bool(mask.any()):
                    out.moves.append(Move(r, q, key, spos[mask], at[mask]))
    out.moves.sort(key=lambda mv: (mv.dst, mv.src))             # stable: keys keep their order
    return out
    # <<< ex12 A


def segments(old: list[np.ndarray], new: list[np.ndarray]):
    """The elements cut where any run of any rank starts or ends: ``(bounds, old_ids, new_ids)``.
    ``old``/``new``: every rank's runs ``[[start, length], ...]`` (in its local order) of one index
    space. Between two consecutive ``bounds`` every rank holds all elements or none, so a
    *segment* is one unit for :func:`plan`: rank r's holding is the segments ``*_ids[r]`` (local
    order), and a plan of segments, expanded (:func:`expand`), is the plan of elements, from a few numbers
    per run instead of one per element."""
    ends = [np.concatenate([r[:, 0], r[:, 0] + r[:, 1]]) for r in (*old, *new)]
    bounds = np.unique(np.concatenate(ends)) if ends else np.zeros(1, np.int64)

    def ids(runs):
        a = np.searchsorted(bounds, runs[:, 0])
        n = np.searchsorted(bounds, runs[:, 0] + runs[:, 1]) - a
        return _aranges(a, n)
    return bounds, [ids(r) for r in old], [ids(r) for r in new]


def _aranges(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a_i, a_i + n_i) for i])``, without a loop."""
    total = int(n.sum())
    return np.repeat(a - np.cumsum(n) + n, n) + np.arange(total, dtype=np.int64)


def expand(p: Plan, bounds: np.ndarray, old_ids: list[np.ndarray], new_ids: list[np.ndarray],
           ranks, run: int = 4096, few: int = 16, blocks: bool = False,
           piece: int = 256) -> tuple[Plan, list[int], list[int]]:
    """The plan of elements of the segment plan ``p`` (:func:`segments`): the moves from or to one of
    ``ranks`` with their element positions, and every rank's elements sent and received (all moves).
    A move whose segments form at most ``few`` runs contiguous on both sides, or runs of ``run``
    elements or more on average, becomes one move per run, with slices (copies at memory speed, no
    index built); the others carry index tensors (one gather for many short runs, not one copy each).
    With ``blocks``, runs of one length at one stride on both sides become one :class:`Block` move
    first (for tensors wrapped in :class:`Flat`), where that leaves few positions or ``piece``
    elements or more each on average."""
    width = np.diff(bounds)
    starts = [np.cumsum(width[i]) - width[i] for i in (*old_ids, *new_ids)]   # element offset of each position
    world = len(old_ids)
    out, sent, received = Plan(p.world_size), [0] * p.world_size, [0] * p.world_size
    for mv in p.moves:
        n = width[old_ids[mv.src][mv.src_pos.numpy()]]
        if mv.src != mv.dst:
            sent[mv.src] += int(n.sum())
            received[mv.dst] += int(n.sum())
        if mv.src not in ranks and mv.dst not in ranks:
            continue
        a, b = starts[mv.src][mv.src_pos.numpy()], starts[world + mv.dst][mv.dst_pos.numpy()]
        cut = np.flatnonzero((a[1:] != a[:-1] + n[:-1]) | (b[1:] != b[:-1] + n[:-1])) + 1
        first = np.concatenate([[0], cut]).astype(np.int64)
        lengths = np.add.reduceat(n, first) if len(n) else n
        pieces = _strided(a[first].tolist(), b[first].tolist(), lengths.tolist()) if blocks else None
        if pieces is not None and (len(pieces) <= few or n.sum() >= piece * len(pieces)):
            out.moves += [Move(mv.src, mv.dst, mv.key, x, y) for x, y in pieces]
        elif len(n) and (len(first) <= few or n.sum() >= run * len(first)):     # few or long runs: slices
            out.moves += [Move(mv.src, mv.dst, mv.key, slice(x, x + m), slice(y, y + m))
                          for x, y, m in zip(a[first].tolist(), b[first].tolist(), lengths.tolist())]
        else:
            out.moves.append(Move(mv.src, mv.dst, mv.key, torch.from_numpy(_aranges(a, n)),
                                  torch.from_numpy(_aranges(b, n))))
    return out, sent, received


def _strided(x: list[int], y: list[int], m: list[int]) -> list[tuple]:
    """Runs ``x[i] → y[i]`` of ``m[i]`` elements as positions: each stretch of two or more runs of one
    length at one stride on both sides a pair of :class:`Block` positions, any other run a pair of
    slices."""
    out, i, k = [], 0, len(m)
    while i < k:
        j = i + 1
        if j < k:
            sx, sy = x[j] - x[i], y[j] - y[i]
            while j < k and m[j] == m[i] and x[j] - x[j - 1] == sx and y[j] - y[j - 1] == sy:
                j += 1
        if j - i >= 2 and sx >= m[i] and sy >= m[i]:
            out.append((Block(x[i], sx, j - i, m[i]), Block(y[i], sy, j - i, m[i])))
        else:
            j = i + 1
            out.append((slice(x[i], x[i] + m[i]), slice(y[i], y[i] + m[i])))
        i = j
    return out



# Contract:
# Given: ``p`` is this rank's ``Plan`` (ranks of ``group``); ``tensors`` its old local tensors
#     by key, ``new_tensors`` the new ones to fill, by key; it returns the bytes this rank's all-to-all event recorded
#     as sent (the event named ``name``).
# ex12.B.values: the values arrive bit for bit; every move between ranks travels in one
#     ``all_to_all_single`` call, the same call for all of them.
# ex12.B.bytes: the all-to-all's observed bytes equal the plan's.
# ex12.B.fp32: fp32 state only (another dtype is a ``NotImplementedError``).
def execute(p, tensors, new_tensors, group=None, name: str = "reshard") -> int:
    """Carry out plan ``p`` on this rank of ``group``: local copies, then one all-to-all (its event
    named ``name``). Returns the bytes this rank's all-to-all event recorded as sent."""
    # >>> ex12 B
    me, world = comm.group_rank(group), p.world_size
    dtypes = {v.dtype for v in (*tensors.values(), *new_tensors.values())}
    if dtypes - {torch.float32}:
        raise NotImplementedError(f"a live switch moves fp32 state, got {sorted(map(str, dtypes))}")
    pairs = {}
    for mv in p.moves:                                     # one pass: the moves by (src, dst), in plan order
        pairs.setdefault((mv.src, mv.dst), []).append(mv)
    for mv in pairs.get((me, me), []):
        new_tensors[mv.key][mv.dst_pos] = tensors[mv.key][mv.src_pos]
    out_moves = [pairs.get((me, d), []) if d != me else [] for d in range(world)]
    in_moves = [pairs.get((s, me), []) if s != me else [] for s in range(world)]
    in_sizes = [sum(mv.numel for mv in ms) for ms in out_moves]
    out_sizes = [sum(mv.numel for mv in ms) for ms in in_moves]
    send = torch.empty(sum(in_sizes), dtype=torch.float32, device=_device(tensors))
    at = 0
    for mv in (mv for ms in out_moves for mv in ms):       # packed straight into the one send buffer
        send[at:at + mv.numel] = tensors[mv.key][mv.src_pos]
        at += mv.numel
    recv = torch.empty(sum(out_sizes), dtype=torch.float32, device=_device(tensors))
    with trace.recording(True):            # observed even where a run records nothing else
        mark = trace.mark()
        comm.all_to_all_single(recv, send, out_sizes, in_sizes, group=group, name=name)
        observed = sum(e["bytes_sent"] for e in trace.since(mark) if e["name"] == name)
    at = 0
    for mv in (mv for ms in in_moves for mv in ms):
        new_tensors[mv.key][mv.dst_pos] = recv[at:at + mv.numel]
        at += mv.numel
    return observed
    # <<< ex12 B


def _device(tensors) -> torch.device:
    return next(iter(tensors.values())).device


def move(old: list[np.ndarray], new: list[np.ndarray], flat_old: torch.Tensor, flat_new: torch.Tensor,
         group=None, name: str = "reshard") -> dict:
    """Move ``flat_old`` (this rank's state, its ``old`` runs laid end to end) into ``flat_new`` (its
    ``new`` runs'), every rank of ``group`` at once: ``old``/``new`` are every rank's runs
    ``[[start, length], ...]`` of one index space, in local order, the same list on every rank.
    Returns ``{"sent", "received"}`` (elements, per rank, by the plan), ``observed`` (the bytes this
    rank's all-to-all recorded), ``moves`` and ``segments``."""
    me = comm.group_rank(group)
    bounds, old_ids, new_ids = segments(old, new)
    units = plan([{"state": torch.from_numpy(i)} for i in old_ids],
                 [{"state": torch.from_numpy(i)} for i in new_ids], {"state": max(len(bounds) - 1, 0)})
    p, sent, received = expand(units, bounds, old_ids, new_ids, {me})
    observed = execute(p, {"state": flat_old}, {"state": flat_new}, group, name)
    return {"sent": sent, "received": received, "observed": observed, "moves": len(units.moves),
            "segments": len(bounds) - 1}
