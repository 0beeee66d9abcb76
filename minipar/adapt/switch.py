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
from .holdings import holdings, scalars, set_scalars
from .moves import concatenated, plan


@torch.no_grad()
def reshard(old, new) -> dict:
    """Move ``old``'s parameters and optimizer state (a :class:`~minipar.hybrid.HybridModel`) into
    ``new`` (another layout of the same model and world). A collective of the whole world.
    Returns the switch's record on this rank: ``bytes_sent`` and ``bytes_received`` (by the plan,
    and ``sent_observed`` by the all-to-all's own event), ``plan_bytes`` (the whole switch),
    ``moves``, ``seconds`` and its ``phases``: ``describe`` (the holdings exchanged as runs),
    ``plan``, ``wait`` (a barrier: the ranks reach the move at different times),
    ``all_to_all`` (the collective's own event) and ``copy`` (the rest of the move:
    packing, local copies, unpacking into the new tensors); ``seconds`` is their sum."""
    phases, t = {}, time.perf_counter()

    def done(phase):
        nonlocal t
        phases[phase], t = time.perf_counter() - t, time.perf_counter()
    with trace.region("reshard"):
        index, views = holdings(old)
        shared = scalars(old)
        olds = [None] * dist.get_world_size()
        dist.all_gather_object(olds, (packed(runs_of(index)), {k: (v.dtype, v.is_floating_point()) for k, v in shared.items()},
                                      {k: views[k][0].dtype for k in views}))
        dtypes = {k: d for _, _, kinds in olds for k, d in kinds.items()}
        create = {}                              # the optimizer state the new layout must have
        for k, dtype in dtypes.items():
            slot, name = k.split("/", 1)
            if slot != "param":
                create.setdefault(name, {})[slot] = (False, dtype)
        for slot, (dtype, _) in next((sc for _, sc, _ in olds if sc), {}).items():
            for name in {k.split("/", 1)[1] for k in dtypes}:
                create.setdefault(name, {})[slot] = (True, dtype)
        olds = [from_runs(unpacked(i)) for i, _, _ in olds]
        new_index, new_views = holdings(new, create)
        news = [None] * dist.get_world_size()
        dist.all_gather_object(news, packed(runs_of(new_index)))
        news = [from_runs(unpacked(i)) for i in news]
        done("describe")
        kinds = sorted({k.split("/", 1)[0] for k in dtypes})
        sizes = {f"{kind}/{n}": s.numel() for n, s in new.full_shapes.items() for kind in kinds}
        sizes = {k: n for k, n in sizes.items() if any(k in h for h in news)}
        mine_old = [k for k in sizes if k in index]            # this rank's keys, in the plan's order
        mine_new = [k for k in sizes if k in new_index]
        p = plan([{"state": i} for i in concatenated(olds, sizes)],
                 [{"state": i} for i in concatenated(news, sizes)], {"state": sum(sizes.values())})
        done("plan")
        dist.barrier()                 # the ranks arrive apart: the wait is not the exchange's
        done("wait")
        device = next(v for vs in new_views.values() for v in vs).device
        flat_new = torch.empty(sum(len(new_index[k]) for k in mine_new), dtype=torch.float32, device=device)
        flat_old = (torch.cat([v for k in mine_old for v in views[k]]) if mine_old
                    else torch.empty(0, dtype=torch.float32, device=device))
        mark = trace.mark()
        observed = _execute(p, {"state": flat_old}, {"state": flat_new})
        exchange = sum(e["end"] - e["start"] for e in trace.since(mark) if e["kind"] == "comm" and e["name"] == "reshard")
        at = 0
        for k in mine_new:
            for v in new_views[k]:
                v.copy_(flat_new[at:at + v.numel()])
                at += v.numel()
        set_scalars(new, shared)
        done("copy")
        phases["copy"] -= exchange                 # what stays: packing, local copies, unpacking
        phases["all_to_all"] = exchange
    me = dist.get_rank()
    received = sum(mv.numel for mv in p.moves if mv.dst == me and mv.src != me) * 4
    return {"bytes_sent": p.sent()[me], "bytes_received": received, "sent_observed": observed,
            "plan_bytes": p.bytes(), "moves": len(p.moves), "seconds": sum(phases.values()), "phases": phases}


def exchange_seconds(sent: list[int], received: list[int], alpha: float, beta: float) -> float:
    """The α-β time of the switch's all-to-all, ``(n − 1)·α + β·max_r max(sent_r, received_r)``:
    a pairwise exchange takes n − 1 steps, one message each way per step (the pairwise-exchange
    all-to-all of Thakur, Rabenseifner & Gropp 2005), and the rank with the most bytes to send or
    receive finishes last.
    ``sent``/``received``: bytes per rank (each rank's record's ``bytes_sent``/``bytes_received``);
    α, β: seconds per message and per byte (:func:`minipar.plan.measure_machine`)."""
    n = len(sent)
    return (n - 1) * alpha + beta * max(max(s, r) for s, r in zip(sent, received)) if n > 1 else 0.0


# Contract:
# ex12.C.runs: ``runs_of(index)`` gives each key's index as its runs of consecutive elements
#     ``[[start, length], ...]``, and ``from_runs(runs_of(i))`` gives back i, an empty index
#     included.
def runs_of(index: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each index tensor as its runs of consecutive elements, ``[[start, length], ...]``: a shard
    of a contiguous range is one run, a column shard one run per row (what travels, not 8 bytes
    per element)."""
    # >>> ex12 C
    out = {}
    for k, i in index.items():
        if len(i) == 0:
            out[k] = torch.zeros(0, 2, dtype=torch.long)
            continue
        breaks = torch.nonzero(i[1:] != i[:-1] + 1).flatten() + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
        ends = torch.cat([breaks, torch.tensor([len(i)])])
        out[k] = torch.stack([i[starts], ends - starts], 1)
    return out
    # <<< ex12 C


def from_runs(runs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The index tensors back from :func:`runs_of`."""
    # >>> ex12 C
    out = {}
    for k, r in runs.items():
        n = int(r[:, 1].sum()) if len(r) else 0
        offsets = torch.repeat_interleave(r[:, 0] - torch.cumsum(r[:, 1], 0) + r[:, 1], r[:, 1])
        out[k] = offsets + torch.arange(n)
    return out
    # <<< ex12 C


def packed(runs: dict[str, torch.Tensor]) -> tuple[list[str], list[int], "numpy.ndarray"]:
    """:func:`runs_of`'s result as one array for the wire: ``(keys, runs per key, all runs)``
    (pickling one NumPy array costs a fraction of pickling a tensor per key)."""
    keys = list(runs)
    flat = torch.cat([runs[k].reshape(-1, 2) for k in keys]) if keys else torch.zeros(0, 2, dtype=torch.long)
    return keys, [len(runs[k]) for k in keys], flat.cpu().numpy()


def unpacked(wire) -> dict[str, torch.Tensor]:
    """The runs by key back from :func:`packed`."""
    keys, counts, flat = wire
    return dict(zip(keys, torch.from_numpy(flat).split(counts)))


# Contract:
# Given: ``p`` is this rank's ``Plan``; ``tensors`` its old local tensors by key, ``new_tensors``
#     the new ones to fill, by key; it returns the bytes this rank's all-to-all event recorded
#     as sent.
# ex12.B.values: the values arrive bit for bit, with one ``all_to_all_single`` for every move
#     between ranks.
# ex12.B.bytes: the all-to-all's observed bytes equal the plan's.
# ex12.B.fp32: fp32 state only (another dtype is a ``NotImplementedError``).
def _execute(p, tensors, new_tensors) -> int:
    """Carry out plan ``p`` on this rank: local copies, then one all-to-all. Returns the bytes
    this rank's all-to-all event recorded as sent."""
    # >>> ex12 B
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
    # <<< ex12 B


def _device(tensors) -> torch.device:
    return next(iter(tensors.values())).device


def _empty(tensors) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=_device(tensors))
