"""The plan of moves between two layouts, computed once, the same on every rank.

A rank's *holding* says which elements of the job's state it keeps: for every key (a parameter,
``param/<name>``, or a slot of its optimizer state, ``exp_avg/<name>``, ...) the global flat
indices of the single-device tensor that its local tensor holds, in local order (its
tensor-parallel shard, its stage's layers, its ZeRO-1 slice). Two layouts give two holdings per
rank; the plan gives every element of the new holdings one source:

    src(q, e) = q                     if rank q already holds e   (a local copy, no bytes)
              = the first holder r of e after q, in the ring order q+1, q+2, ...  (otherwise)

so a switch never sends what a rank has, and the sources of one element spread over its
holders. The plan's bytes, Σ over moves with src ≠ dst of elements × element size, are what the
switch must send and nothing more: :func:`minipar.adapt.switch.reshard` sends exactly these
(a test counts them independently). An element that no rank holds is an error, never a zero."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Move:
    """``src``'s elements ``src_pos`` (local positions) of ``key`` become ``dst``'s ``dst_pos``."""
    src: int
    dst: int
    key: str
    src_pos: torch.Tensor
    dst_pos: torch.Tensor

    @property
    def numel(self) -> int:
        return len(self.dst_pos)


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


def concatenated(holdings: list[dict[str, torch.Tensor]], sizes: dict[str, int]) -> list[torch.Tensor]:
    """Every rank's holding as one index into the keys laid end to end (``sizes``' order): the
    plan of all keys at once (one key, ``"state"``, of Σ sizes elements), in few operations."""
    offset, at = {}, 0
    for k, n in sizes.items():
        offset[k], at = at, at + n
    return [torch.cat([h[k] + offset[k] for k in sizes if k in h] or [torch.zeros(0, dtype=torch.long)])
            for h in holdings]
