"""Where a rank's tensor sits inside the full (single-device) tensor: boxes and pieces.

A layout-independent checkpoint names every tensor by the single-device model's parameter
name and says which part of the full tensor each saved piece is, with two ideas:

* a **box**: ``(offset, shape)``, the sub-block ``full[o0:o0+s0, o1:o1+s1, ...]``. A
  tensor-parallel shard is one box (rows or columns) or, for the fused ``[q; k; v]``
  weight, three boxes stacked on dim 0; a replicated tensor is the box of the whole. Every
  local tensor here is its boxes laid end to end in row-major order.
* a **flat range** ``[lo, hi)`` inside a box's row-major flattening: ZeRO shards the
  flattened parameters, so a rank's optimizer state may start and end mid-row.

A :class:`Piece` is one (box, flat range) of one tensor (``key``: ``"param"`` or an
optimizer-state name such as ``"exp_avg"``). Saving writes pieces; loading assembles the
full tensor from them (:func:`assemble`) and cuts out the pieces the new layout needs
(:func:`extract`), so a checkpoint saved on one mesh loads on any other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the full tensor


@dataclass
class Piece:
    """Elements ``[lo, hi)`` of box ``(offset, shape)`` of the full tensor ``name``/``key``.

    ``data`` is a 1-D tensor of ``hi - lo`` elements: when saving, a copy of what the rank
    holds; when loading, a *view* into the live parameter or optimizer state to fill."""

    name: str
    key: str
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    lo: int
    hi: int
    data: torch.Tensor | None = field(default=None, repr=False)

    def descriptor(self) -> tuple:
        """Everything but the data: equal descriptors on two ranks mean replicated copies."""
        return (self.name, self.key, tuple(self.full_shape), tuple(self.offset),
                tuple(self.shape), self.lo, self.hi)

    def to_record(self) -> dict:
        """A dict of plain types and one tensor (what ``torch.load(weights_only=True)`` reads)."""
        return {"name": self.name, "key": self.key, "full_shape": list(self.full_shape),
                "offset": list(self.offset), "shape": list(self.shape), "lo": self.lo,
                "hi": self.hi, "data": self.data}

    @classmethod
    def from_record(cls, r: dict) -> "Piece":
        return cls(r["name"], r["key"], tuple(r["full_shape"]), tuple(r["offset"]),
                   tuple(r["shape"]), r["lo"], r["hi"], r["data"])


def whole(full_shape) -> list[Box]:
    """The box of the whole tensor: a replicated (or unsharded) parameter."""
    full_shape = tuple(full_shape)
    return [((0,) * len(full_shape), full_shape)]


def split_box(full_shape, dim: int, parts: int, index: int) -> Box:
    """Part ``index`` of ``parts`` equal parts of the full tensor along ``dim``."""
    size = full_shape[dim] // parts
    return (tuple(index * size if d == dim else 0 for d in range(len(full_shape))),
            tuple(size if d == dim else s for d, s in enumerate(full_shape)))


def tensor_parallel_boxes(kind: str | None, full_shape, t: int, r: int) -> list[Box]:
    """Boxes of rank ``r``'s shard (of ``t``) for a layout ``kind`` of
    :mod:`minipar.tensor_parallel.gpt`: ``"rows"``, ``"cols"``, ``"qkv"`` or ``None``."""
    full_shape = tuple(full_shape)
    if kind is None or t == 1:
        return whole(full_shape)
    if kind == "rows":
        return [split_box(full_shape, 0, t, r)]
    if kind == "cols":
        return [split_box(full_shape, 1, t, r)]
    if kind == "qkv":  # [q; k; v] stacked on dim 0: this rank's rows of each third
        third = full_shape[0] // 3
        (o, *rest), shape = split_box((third, *full_shape[1:]), 0, t, r)
        return [((j * third + o, *rest), shape) for j in range(3)]
    raise ValueError(f"unknown tensor-parallel layout {kind!r}")


def pieces_of(name: str, key: str, full_shape, boxes: list[Box], local: torch.Tensor,
              lo: int = 0, hi: int | None = None, flat: torch.Tensor | None = None) -> list[Piece]:
    """The pieces of ``local`` (its boxes end to end) that fall in its flat range ``[lo, hi)``.

    ``flat``: the tensor holding elements ``lo..hi`` of ``local``'s flattening (default
    ``local.reshape(-1)[lo:hi]``); each piece's ``data`` is a view into it."""
    n = sum(math.prod(s) for _, s in boxes)
    if n != local.numel():
        raise ValueError(f"{name}: boxes cover {n} elements, the local tensor has {local.numel()}")
    hi = n if hi is None else hi
    if flat is None:
        if not local.is_contiguous():  # reshape would copy, and loading would fill the copy
            raise ValueError(f"{name}: the local tensor is not contiguous")
        flat = local.reshape(-1)[lo:hi]
    out, start = [], 0
    for offset, shape in boxes:
        size = math.prod(shape)
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            out.append(Piece(name, key, tuple(full_shape), offset, shape, a - start, b - start,
                             flat[a - lo:b - lo]))
        start += size
    return out


def _region(full: torch.Tensor, p: Piece) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))]


def assemble(pieces: list[Piece], full_shape, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The full tensor from saved ``pieces``, and a bool mask of the elements they covered."""
    dtype = dtype or pieces[0].data.dtype
    where = pieces[0].data.device
    full = torch.zeros(tuple(full_shape), dtype=dtype, device=where)
    seen = torch.zeros(tuple(full_shape), dtype=torch.bool, device=where)
    for p in pieces:
        for t, v in ((full, p.data.to(dtype)), (seen, torch.ones((), dtype=torch.bool, device=where))):
            region = _region(t, p)
            if p.lo == 0 and p.hi == region.numel():
                region.copy_(v.reshape(p.shape) if v.dim() else v)
            else:  # a flat range: edit the box's flattening, then write the box back
                box = region.reshape(-1).clone()
                box[p.lo:p.hi] = v
                region.copy_(box.view(p.shape))
    return full, seen


def extract(full: torch.Tensor, p: Piece) -> torch.Tensor:
    """Elements ``[p.lo, p.hi)`` of box ``p`` of ``full``, flattened."""
    return _region(full, p).reshape(-1)[p.lo:p.hi]
