"""A switch's plan, made once per pair of layouts and kept.

What a rank holds is decided by the layouts, not by the values: the same pair of layouts gives
every rank the same holdings, the same segments and the same moves every time. So a switch
describes each rank's state by its *geometry* (every piece's box and flat range,
:meth:`~minipar.pieces.boxes.Piece.descriptor`, and its dtype), hashes it (16 bytes) and gathers
the hashes: one collective of 32 bytes a rank. Each rank also sends the key it expects the
world's hashes to make (the last one it planned with its own hash); when every rank expected
the key they make together, every rank has that plan and uses it (:func:`known`). Otherwise every
rank exchanges its holdings as runs (:func:`gather_runs`: one ``int64`` tensor a rank, sizes first,
no pickling) and plans; the plan is kept under that key (at most :data:`KEPT` pairs, the oldest
dropped first, the same on every rank since every rank switches the same way).

The key includes the code of ``plan`` and ``execute``, so a plan made by or for another (an
exercise's) is not reused by the library's."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .. import moves

KEPT = 16


@dataclass
class Planned:
    """This rank's side of one switch's plan: ``p`` (its moves, expanded), every rank's elements
    ``sent``/``received``, ``moves``/``segments`` (the plan's units), the optimizer state to
    create in the new layout (``create``), the keys in the order the flat buffers the moves index
    lay them (``old_order``, ``new_order``), the number of new pieces
    and their elements (``new_count``, ``new_numel``: what a kept plan checks) and ``shared_from``: the rank whose 0-d state
    (``step``) every rank takes, when some rank of the new layout holds none of the old's, and
    its slots (``shared_slots``)."""
    p: moves.Plan
    sent: list[int]
    received: list[int]
    moves: int
    segments: int
    create: dict
    old_order: list[str]
    new_order: list[str]
    new_count: int
    new_numel: int
    shared_from: int | None = None
    shared_slots: list[str] | None = None
    by_piece: tuple | None = None     # ((old sizes, new sizes), p cut at its pieces or None: moves.by_piece)
    splits: tuple | None = None       # this rank's all-to-all split sizes (cut.splits)


_KEPT: dict = {}    # (world key, plan's code) -> Planned
_LAST: dict = {}    # (this rank's hash, plan's code) -> the world key it was last planned under


def geometry(old_pieces, new) -> bytes:
    """16 bytes that name this rank's side of a switch: the old pieces' descriptors and dtypes (the
    optimizer state included: what the new layout's optimizer state is made from) and what decides
    the new :class:`~minipar.hybrid.HybridModel`'s pieces: its parallelism (every option, decided),
    this rank's coordinates on its mesh, its pipeline cut, the model's shapes and the optimizer's
    kind. (A kept plan also checks the new pieces' count and elements before it is used.)"""
    text = repr(([q.descriptor() + (str(q.data.dtype),) for q in old_pieces], repr(new.plan),
                 sorted(new.coords.items()), tuple(new.bounds), [(k, tuple(v)) for k, v in new.full_shapes.items()],
                 type(new.optimizer).__module__, type(new.optimizer).__qualname__,
                 [type(part).__qualname__ for part in getattr(new.optimizer, "parts", ())]))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _code():
    codes = moves.plan.__code__, moves.execute.__code__
    return tuple(map(id, codes)), codes     # the objects themselves: their ids are not reused while kept


def known(mine: bytes, device) -> tuple[bytes, Planned | None]:
    """The world's key of this switch (every rank's :func:`geometry` hash) and the plan kept under
    it if every rank has it (the same answer on every rank), else ``None``. One all-gather."""
    expect = _LAST.get((mine, _code()), bytes(16))
    t = torch.frombuffer(bytearray(mine + expect), dtype=torch.int64).to(device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    rows = [o.cpu().numpy().tobytes() for o in out]
    key = hashlib.blake2b(b"".join(r[:16] for r in rows), digest_size=16).digest()
    if all(r[16:] == key for r in rows):
        return key, _KEPT[(key, _code())]
    return key, None


def keep(mine: bytes, key: bytes, planned: Planned) -> None:
    _KEPT[(key, _code())] = planned
    _LAST[(mine, _code())] = key
    while len(_KEPT) > KEPT:
        del _KEPT[next(iter(_KEPT))]


def gather_runs(held, meta: dict, device) -> list[tuple[tuple, dict]]:
    """Every rank's ``(held, meta)``: ``held`` as :func:`~minipar.adapt.holdings.held_runs` gives it
    (keys, runs per key, runs), ``meta`` a small JSON-able dict. One ``int64`` tensor a rank:
    its length gathered first, then the tensors (padded to the longest)."""
    keys, counts, runs = held
    raw = json.dumps([list(keys), meta]).encode()
    text = np.frombuffer(raw.ljust(-(-len(raw) // 8) * 8), np.int64)      # padded with spaces
    flat = np.concatenate([[len(text), len(counts)], text, np.asarray(counts, np.int64),
                           np.asarray(runs, np.int64).reshape(-1)]).astype(np.int64)
    world = dist.get_world_size()
    n = torch.tensor([len(flat)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    t = torch.zeros(max(sizes), dtype=torch.int64, device=device)
    t[:len(flat)] = torch.from_numpy(flat).to(device)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    result = []
    for o, size in zip(out, sizes):
        a = o.cpu().numpy()[:size]
        nt, nk = int(a[0]), int(a[1])
        ks, m = json.loads(a[2:2 + nt].tobytes().decode().rstrip(" "))
        c = a[2 + nt:2 + nt + nk]
        result.append(((ks, c, a[2 + nt + nk:].reshape(-1, 2)), m))
    return result
