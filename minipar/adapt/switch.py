"""A live layout switch: the state moves from its old owners to its new ones, no disk involved.

What a switch promises (its contract, whatever the implementation):

* every element of every parameter and optimizer slot the new layout holds ends up, bit for bit,
  where the new layout keeps it, from one rank of the old layout that held it (the rank itself
  when it did: what a rank keeps is never sent);
* what travels is what the plan of moves (:func:`minipar.moves.plan`) says each rank lacks, in
  one ``all_to_all_single`` for the whole switch, whose own count of bytes equals the plan's;
* an element no old rank holds is an error, never a zero; fp32 state only.

So the next step of the new layout is the step the old one would have taken (up to the new
layout's order of sums). The holdings (:mod:`.holdings`) travel as runs of indices, not values;
the plan of a pair of layouts is made once and kept (:mod:`.plans`); the plan and the
all-to-all are :mod:`minipar.moves`, which chapter 04's re-partitioning uses as well (the
library's own switch carries out :func:`minipar.moves.execute`'s moves with
:func:`.cut.exchange`: the same moves, one copy per element a side, into a kept buffer). Its cost is
measured against the α-β time of its all-to-all (:func:`exchange_seconds`), α and β fitted on
the all-to-all itself (:func:`measure_exchange`)."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import comm
from ..moves import execute as _execute       # the one mechanism that moves state (chapter 04's too)
from ..moves import Flat, expand, plan, segments
from ..pieces import local_pieces
from ..runtime import trace
from . import plans
from .cut import Views, by_piece, splits
from .cut import exchange as _exchange
from .holdings import held_runs


_LIBRARY_EXECUTE = _execute.__code__


@torch.no_grad()
def reshard(old, new, alpha_beta: tuple[float, float] | None = None) -> dict:
    """Move ``old``'s parameters and optimizer state (a :class:`~minipar.hybrid.HybridModel`) into
    ``new`` (another layout of the same model and world). A collective of the whole world.
    Returns the switch's record on this rank: ``bytes_sent`` and ``bytes_received`` (by the plan,
    and ``sent_observed`` by the all-to-all's own event), ``plan_bytes`` (the whole switch),
    ``splits`` (the elements it sends to, and receives from, each rank: its all-to-all's split
    sizes), ``moves``, ``segments`` (the units planned), ``plan_kept`` (the plan of this pair of layouts
    was made before: :mod:`.plans`), ``seconds`` and its ``phases``: ``wait`` (the
    ranks reach the switch at different times: the time of its first collective, the all-gather of
    the geometry's hash), ``describe`` (the pieces of both layouts and the hash of this rank's
    side; when the plan is new, the holdings as runs, exchanged), ``plan``
    (cut into segments, planned, expanded to this rank's elements and cut at its pieces; nothing
    when kept), ``all_to_all`` (the collective's own event, from its start to its wait: what a rank
    keeps is copied piece to piece while it is in flight) and ``copy`` (the rest of the move:
    packing from the old pieces, unpacking into the new pieces: no
    flat copy of the state); ``seconds`` is their sum. ``busiest_bytes``: the most
    any rank sends or receives, what bounds the exchange (:func:`exchange_seconds`); with
    ``alpha_beta`` (this machine's α, β of the all-to-all: :func:`measure_exchange`) also
    ``alpha_beta_s``, that bound, and ``over_alpha_beta``: the switch without its wait, over it
    (the goal: at most 2)."""
    phases, t = {}, time.perf_counter()

    def done(phase):
        nonlocal t
        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - t
        t = time.perf_counter()
    world, me = dist.get_world_size(), dist.get_rank()
    device = new.device
    with trace.region("reshard"):
        old_pieces = local_pieces(old, old.optimizer)
        mine = plans.geometry(old_pieces, new)
        done("describe")
        key, planned = plans.known(mine, device)   # the first collective, where the ranks meet: they
        done("wait")                               # arrive apart, and that wait is not the switch's
        kept = planned is not None
        if not kept:
            planned = _plan(old, new, old_pieces, device, done)
            plans.keep(mine, key, planned)
        new_pieces = local_pieces(new, new.optimizer, planned.create)
        views, shared = by_key(old_pieces)
        new_views, new_shared = by_key(new_pieces)
        targets = [v for k in planned.new_order for v in new_views[k]]
        numel = sum(v.numel() for v in targets)
        if (len(new_pieces), numel) != (planned.new_count, planned.new_numel):
            raise RuntimeError(f"the new layout holds {len(new_pieces)} pieces of {numel} elements, its kept "
                               f"plan {planned.new_count} of {planned.new_numel}")
        done("describe")
        sources = [v for k in planned.old_order for v in views[k]]
        shape = ([v.numel() for v in sources], [v.numel() for v in targets])
        if planned.by_piece is None or planned.by_piece[0] != shape:    # the moves cut at the pieces' ends
            direct = _own_execute() and all(v.dim() == 1 and (v.stride(0) == 1 or v.numel() < 2)
                                            for v in (*sources, *targets))      # as the geometry decides
            planned.by_piece = (shape, by_piece(planned.p, me, *shape) if direct else None)
        direct = planned.by_piece[1] is not None
        done("plan")
        mark = trace.mark()
        if direct:                          # packed from, unpacked into, the live pieces themselves
            observed = _exchange(planned.by_piece[1], Views(sources, 0, device), Views(targets, 1, device))
        else:                               # an exercise's execute: flat buffers, index and slice positions
            flat_new = torch.empty(numel, dtype=torch.float32, device=device)
            flat_old = torch.cat(sources) if sources else torch.empty(0, dtype=torch.float32, device=device)
            wrap = Flat if _own_execute() else (lambda t: t)    # Block positions: the library's own execute
            observed = _execute(planned.p, {"state": wrap(flat_old)}, {"state": wrap(flat_new)})
            if targets:
                torch._foreach_copy_(targets, flat_new.split([v.numel() for v in targets]))
        exchange = sum(e["end"] - e["start"] for e in trace.since(mark) if e["kind"] == "comm" and e["name"] == "reshard")
        _shared_state(planned, shared, new_shared, device)
        done("copy")
        phases["copy"] -= exchange                 # what stays: packing, unpacking
        phases["all_to_all"] = exchange
    sent, received = planned.sent, planned.received
    if planned.splits is None:
        planned.splits = splits(planned.p, me)
    out = {"bytes_sent": sent[me] * 4, "bytes_received": received[me] * 4, "sent_observed": observed,
           "splits": planned.splits,
           "plan_bytes": sum(sent) * 4, "busiest_bytes": 4 * max(max(sent), max(received)), "world": world,
           "moves": planned.moves, "segments": planned.segments, "plan_kept": kept,
           "seconds": sum(phases.values()), "phases": phases}
    if alpha_beta is not None:
        out["alpha_beta_s"] = exchange_seconds([4 * x for x in sent], [4 * x for x in received], *alpha_beta)
        out["over_alpha_beta"] = ((out["seconds"] - phases["wait"]) / out["alpha_beta_s"] if out["alpha_beta_s"] > 0
                                  else float("inf"))       # α and β of 0 (a fit on a loaded machine), no bytes
    return out


def _own_execute() -> bool:
    """Whether :func:`minipar.moves.execute` is the library's own (an exercise's is given the plan in
    its contract's positions: index tensors and slices, no :class:`~minipar.moves.Block`)."""
    return _execute.__code__ is _LIBRARY_EXECUTE


def by_key(pieces) -> tuple[dict, dict]:
    """``(views, shared)`` of ``pieces``: the 1-D views by key ``"<slot>/<name>"`` (each key's in
    local order), and the 0-d slots (``step``) by slot."""
    views, shared = {}, {}
    for q in pieces:
        if q.full_shape:
            views.setdefault(f"{q.key}/{q.name}", []).append(q.data)
        else:
            shared.setdefault(q.key, []).append(q.data)
    return views, shared


def _dtype(text: str) -> torch.dtype:
    return getattr(torch, text.split(".")[-1])


def _plan(old, new, old_pieces, device, done) -> plans.Planned:
    """A plan not made before: every rank's holdings, old then new, exchanged as runs
    (:func:`~.plans.gather_runs`), cut into segments, planned and expanded to this rank's moves."""
    me = dist.get_rank()
    held, views, shared = held_runs(old, pieces=old_pieces)
    olds = plans.gather_runs(held, {"slots": {k: str(views[k][0].dtype) for k in views},
                                    "shared": {k: str(v[0].dtype) for k, v in shared.items()}}, device)
    dtypes = {k: d for _, m in olds for k, d in m["slots"].items()}
    create = {}                              # the optimizer state the new layout must have
    for k, dtype in dtypes.items():
        slot, name = k.split("/", 1)
        if slot != "param":
            create.setdefault(name, {})[slot] = (False, _dtype(dtype))
    shared_from = next((r for r, (_, m) in enumerate(olds) if m["shared"]), None)   # the first rank that has them
    olds_shared = olds[shared_from][1]["shared"] if shared_from is not None else {}
    for slot, dtype in olds_shared.items():
        for name in {k.split("/", 1)[1] for k in dtypes}:
            create.setdefault(name, {})[slot] = (True, _dtype(dtype))
    olds = [h for h, _ in olds]
    new_pieces = local_pieces(new, new.optimizer, create)
    new_held, new_views, new_shared = held_runs(new, pieces=new_pieces)
    news = plans.gather_runs(new_held, {"shared": bool(new_shared), "had": bool(shared)}, device)
    if not any(m["shared"] and not m["had"] for _, m in news):
        shared_from = None                   # every rank that needs the 0-d state has it
    news = [h for h, _ in news]
    done("describe")
    kinds = sorted({k.split("/", 1)[0] for k in dtypes})
    anywhere = {k for keys, _, _ in news for k in keys}
    sizes = {f"{kind}/{n}": s.numel() for n, s in new.full_shapes.items() for kind in kinds}
    sizes = {k: n for k, n in sizes.items() if k in anywhere}
    bounds, old_ids, new_ids = segments(laid_end_to_end(olds, sizes), laid_end_to_end(news, sizes))
    units = plan([{"state": torch.from_numpy(i)} for i in old_ids],
                 [{"state": torch.from_numpy(i)} for i in new_ids], {"state": max(len(bounds) - 1, 0)})
    p, sent, received = expand(units, bounds, old_ids, new_ids, {me}, blocks=_own_execute())
    done("plan")
    slots = sorted(olds_shared) if shared_from is not None else []
    new_order = [k for k in sizes if k in new_views]
    return plans.Planned(p, sent, received, len(units.moves), len(bounds) - 1, create,
                         [k for k in sizes if k in views], new_order, len(new_pieces),
                         sum(v.numel() for k in new_order for v in new_views[k]), shared_from, slots)


def _shared_state(planned, shared, new_shared, device) -> None:
    """The 0-d state every parameter shares (Adam's ``step``) into the new layout's: this rank's
    own value, or ``shared_from``'s (a broadcast) when some rank of the new layout had none."""
    shared_from, slots = planned.shared_from, planned.shared_slots
    if shared_from is not None:
        values = torch.tensor([float(shared[k][0]) if k in shared else 0.0 for k in slots], dtype=torch.float64,
                              device=device)
        dist.broadcast(values, src=shared_from)
        shared = {k: [v.reshape(1)] for k, v in zip(slots, values.cpu())}
    for k, vs in new_shared.items():
        for v in vs if k in shared else ():
            v.copy_(shared[k][0].reshape(v.shape))


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


def measure_exchange(per_rank=(1 << 10, 1 << 16, 1 << 21, 1 << 23), repeats: int = 5, group=None,
                     device=None) -> tuple[float, float]:
    """This machine's α, β of the all-to-all at this world (a collective of ``group``): the median
    of ``repeats`` all-to-alls (each after a barrier) of ``per_rank`` bytes each rank sends, in
    n − 1 equal messages, fitted by :func:`fit_exchange`. Fit on sizes that reach a switch's
    busiest bytes: a large exchange runs slower per byte than a small one predicts."""
    world = comm.group_size(group)
    if world < 2:
        return 0.0, 0.0
    seconds = {}
    for nbytes in per_rank:
        x = torch.zeros(max(nbytes // 4 // (world - 1), 1) * world, device=device)
        y = torch.empty_like(x)
        runs = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            comm.all_to_all_single(y, x, group=group, name="probe")
            runs.append(time.perf_counter() - t0)
        seconds[x.numel() // world * (world - 1) * 4] = statistics.median(runs)
    return fit_exchange(seconds, world)


def fit_exchange(seconds: dict[int, float], world: int) -> tuple[float, float]:
    """α, β of ``(n − 1)·α + β·B`` (:func:`exchange_seconds`) from all-to-alls of ``B`` bytes per
    rank, least squares on the relative error (small and large count alike)."""
    b = np.array(list(seconds), float)
    t = np.array(list(seconds.values()))
    x = np.stack([np.full_like(b, world - 1), b], 1) / t[:, None]
    alpha, beta = np.linalg.lstsq(x, np.ones_like(t), rcond=None)[0]
    return max(float(alpha), 0.0), max(float(beta), 1e-15)


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
