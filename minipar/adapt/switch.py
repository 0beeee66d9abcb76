"""A live layout switch: the state moves from its old owners to its new ones, no disk involved.

Every rank describes what it holds now and what it will hold (:mod:`.holdings`); the
descriptions are exchanged once (``all_gather_object``: indices, not values), every rank
computes the same :func:`~minipar.adapt.moves.plan`, and one ``all_to_all_single`` carries every
value that changes rank: rank s packs, for each destination in rank order, the elements of its
moves to it in plan order; rank d unpacks them in the same order. Elements a rank keeps are
copied locally and never sent. The values are copied bit for bit, so the next step of the new
layout is the step the old one would have taken (up to the new layout's order of sums)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import comm
from ..runtime import trace
from .holdings import holdings, prime, slot_names
from .moves import plan


@torch.no_grad()
def reshard(old, new) -> dict:
    """Move ``old``'s parameters and optimizer state (a :class:`~minipar.hybrid.HybridModel`) into
    ``new`` (another layout of the same model and world). A collective of the whole world.
    Returns the switch's record on this rank: ``bytes_sent`` (by the plan, and ``sent_observed``
    by the all-to-all's own event), ``plan_bytes`` (the whole switch), ``moves`` and ``seconds``."""
    t0 = time.perf_counter()
    with trace.region("reshard"):
        index, tensors, scalars = holdings(old)
        olds = [None] * dist.get_world_size()
        dist.all_gather_object(olds, (index, scalars))
        slots = sorted({s for i, _ in olds for s in slot_names(i)})
        prime(new, slots, next((sc for _, sc in olds if sc), {}))
        new_index, new_tensors, _ = holdings(new)
        news = [None] * dist.get_world_size()
        dist.all_gather_object(news, new_index)
        sizes = {f"{kind}/{n}": s.numel() for n, s in new.full_shapes.items()
                 for kind in ["param"] + slots}
        sizes = {k: n for k, n in sizes.items() if any(k in h for h in news)}
        p = plan([i for i, _ in olds], news, sizes)
        observed = _execute(p, tensors, new_tensors)
    return {"bytes_sent": p.sent()[dist.get_rank()], "sent_observed": observed, "plan_bytes": p.bytes(),
            "moves": len(p.moves), "seconds": time.perf_counter() - t0}


def _execute(p, tensors, new_tensors) -> int:
    """Carry out plan ``p`` on this rank: local copies, then one all-to-all. Returns the bytes
    this rank's all-to-all event recorded as sent."""
    me, world = dist.get_rank(), p.world_size
    dtypes = {v.dtype for v in (*tensors.values(), *new_tensors.values())}
    if dtypes - {torch.float32}:
        raise NotImplementedError(f"a live switch moves fp32 state, got {sorted(map(str, dtypes))}")
    for mv in p.between(me, me):
        new_tensors[mv.key][mv.dst_pos] = tensors[mv.key][mv.src_pos]
    out_moves = [[mv for mv in p.between(me, d)] for d in range(world)]
    in_moves = [[mv for mv in p.between(s, me)] for s in range(world)]
    send = [torch.cat([tensors[mv.key][mv.src_pos] for mv in ms]) if ms and d != me else _empty(tensors)
            for d, ms in enumerate(out_moves)]
    in_sizes = [len(x) for x in send]
    out_sizes = [sum(mv.numel for mv in ms) if s != me else 0 for s, ms in enumerate(in_moves)]
    recv = torch.empty(sum(out_sizes), dtype=torch.float32, device=_device(tensors))
    with trace.recording(True):            # observed even where a run records nothing else
        mark = trace.mark()
        comm.all_to_all_single(recv, torch.cat(send), out_sizes, in_sizes, name="reshard")
        observed = sum(e["bytes_sent"] for e in trace.since(mark) if e["name"] == "reshard")
    at = 0
    for s, ms in enumerate(in_moves):
        if s == me:
            continue
        for mv in ms:
            new_tensors[mv.key][mv.dst_pos] = recv[at:at + mv.numel]
            at += mv.numel
    return observed


def _device(tensors) -> torch.device:
    return next(iter(tensors.values())).device


def _empty(tensors) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=_device(tensors))
