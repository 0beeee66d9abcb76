"""A live layout switch: the state moves from its old owners to its new ones, no disk involved.

Every rank describes what it holds now and what it will hold (:mod:`.holdings`); the
descriptions are exchanged once (``all_gather_object``: indices, not values), every rank
computes the same :func:`~minipar.adapt.moves.plan`, and one ``all_to_all_single`` carries every
value that changes rank: rank s packs, for each destination in rank order, the elements of its
moves to it in plan order; rank d unpacks them in the same order. Elements a rank keeps are
copied locally and never sent. The values are copied bit for bit, so the next step of the new
layout is the step the old one would have taken (up to the new layout's order of sums). The plan
and the all-to-all are :mod:`minipar.moves`, which chapter 04's re-partitioning uses as well."""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from ..moves import execute as _execute       # the one mechanism that moves state (chapter 04's too)
from ..moves import expand, plan, segments
from ..runtime import trace
from .holdings import held_runs


@torch.no_grad()
def reshard(old, new, alpha_beta: tuple[float, float] | None = None) -> dict:
    """Move ``old``'s parameters and optimizer state (a :class:`~minipar.hybrid.HybridModel`) into
    ``new`` (another layout of the same model and world). A collective of the whole world.
    Returns the switch's record on this rank: ``bytes_sent`` and ``bytes_received`` (by the plan,
    and ``sent_observed`` by the all-to-all's own event), ``plan_bytes`` (the whole switch),
    ``moves``, ``segments`` (the units planned), ``seconds`` and its ``phases``: ``wait`` (a
    barrier first: the ranks reach the switch at different times), ``describe`` (the holdings as
    runs, exchanged), ``plan`` (cut into segments, planned, expanded to this rank's elements), ``all_to_all``
    (the collective's own event) and ``copy`` (the rest of the move: packing, local copies,
    unpacking into the new tensors); ``seconds`` is their sum. ``busiest_bytes``: the most any rank
    sends or receives, what bounds the exchange (:func:`exchange_seconds`); with ``alpha_beta``
    (this machine's α, β of the all-to-all) also ``alpha_beta_s``, that bound, and ``over_alpha_beta``:
    the switch without its wait, over it (the goal: at most 2)."""
    phases, t = {}, time.perf_counter()

    def done(phase):
        nonlocal t
        phases[phase], t = time.perf_counter() - t, time.perf_counter()
    world, me = dist.get_world_size(), dist.get_rank()
    with trace.region("reshard"):
        dist.barrier()                 # the ranks arrive apart: the wait is not the switch's
        done("wait")
        held, views, shared = held_runs(old)
        olds = [None] * world
        dist.all_gather_object(olds, (held, {k: v[0].cpu() for k, v in shared.items()},
                                      {k: views[k][0].dtype for k in views}))
        dtypes = {k: d for _, _, kinds in olds for k, d in kinds.items()}
        create = {}                              # the optimizer state the new layout must have
        for k, dtype in dtypes.items():
            slot, name = k.split("/", 1)
            if slot != "param":
                create.setdefault(name, {})[slot] = (False, dtype)
        shared = next((sc for _, sc, _ in olds if sc), {})     # the first rank's that has them
        for slot, value in shared.items():
            for name in {k.split("/", 1)[1] for k in dtypes}:
                create.setdefault(name, {})[slot] = (True, value.dtype)
        olds = [h for h, _, _ in olds]
        new_held, new_views, new_shared = held_runs(new, create)
        news = [None] * world
        dist.all_gather_object(news, new_held)
        done("describe")
        kinds = sorted({k.split("/", 1)[0] for k in dtypes})
        anywhere = {k for keys, _, _ in news for k in keys}
        sizes = {f"{kind}/{n}": s.numel() for n, s in new.full_shapes.items() for kind in kinds}
        sizes = {k: n for k, n in sizes.items() if k in anywhere}
        mine_old = [k for k in sizes if k in views]            # this rank's keys, in the plan's order
        mine_new = [k for k in sizes if k in new_views]
        bounds, old_ids, new_ids = segments(laid_end_to_end(olds, sizes), laid_end_to_end(news, sizes))
        units = plan([{"state": torch.from_numpy(i)} for i in old_ids],
                     [{"state": torch.from_numpy(i)} for i in new_ids], {"state": max(len(bounds) - 1, 0)})
        p, sent, received = expand(units, bounds, old_ids, new_ids, {me})
        done("plan")
        device = next(v for vs in new_views.values() for v in vs).device
        flat_new = torch.empty(sum(v.numel() for k in mine_new for v in new_views[k]), dtype=torch.float32,
                               device=device)
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
        for k, vs in new_shared.items():          # 0-d state every parameter shares (step)
            for v in vs if k in shared else ():
                v.copy_(shared[k].reshape(v.shape))
        done("copy")
        phases["copy"] -= exchange                 # what stays: packing, local copies, unpacking
        phases["all_to_all"] = exchange
    out = {"bytes_sent": sent[me] * 4, "bytes_received": received[me] * 4, "sent_observed": observed,
           "plan_bytes": sum(sent) * 4, "busiest_bytes": 4 * max(max(sent), max(received)), "world": world,
           "moves": len(units.moves), "segments": len(bounds) - 1, "seconds": sum(phases.values()), "phases": phases}
    if alpha_beta is not None:
        out["alpha_beta_s"] = exchange_seconds([4 * x for x in sent], [4 * x for x in received], *alpha_beta)
        out["over_alpha_beta"] = (out["seconds"] - phases["wait"]) / out["alpha_beta_s"]
    return out


def laid_end_to_end(held: list, sizes: dict[str, int]) -> list[np.ndarray]:
    """Every rank's runs (:func:`~minipar.adapt.holdings.held_runs`' ``(keys, counts, runs)``) as
    runs of one index space, the keys laid end to end in ``sizes``' order (the order every rank
    packs its state in), in a few array operations per rank."""
    at = dict(zip(sizes, range(len(sizes))))
    offset = np.concatenate([[0], np.cumsum(list(sizes.values()))]).astype(np.int64)
    out = []
    for keys, counts, runs in held:
        unknown = [k for k in keys if k not in at]
        if unknown:
            raise ValueError(f"{unknown[:3]}: held by the old layout, by no rank of the new one")
        which = np.repeat(np.array([at[k] for k in keys], np.int64), counts)
        order = np.argsort(which, kind="stable")
        out.append(runs[order] + np.stack([offset[which[order]], np.zeros(len(order), np.int64)], 1))
    return out


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
