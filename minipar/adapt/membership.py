"""A job that changes its members while it trains, without restarting the ranks that stay.

A rank joins (grow) or leaves cleanly (shrink) at a step boundary; the ranks that stay keep
their process and their state, which moves to its new owners as in a live switch
(:func:`~minipar.adapt.switch.reshard`: the holdings described as runs, one plan, one
all-to-all). The job keeps one store (``minipar.runtime.rendezvous``), and each set of members
is a *generation* with its own process group, its keys under its own prefix of the store.

1. A joiner takes a ticket ``i`` (``add("joiners", 1)``), writes ``joiner/i`` and waits for ``admit/i``.
2. After every step the members agree on a :class:`Change`: one ``all_gather_object`` of each
   rank's wish to leave and, from rank 0, how many joiners wait. Every member sees the same
   answer at the same step.
3. Rank 0 admits the joiners: ``admit/i`` gives each its generation, rank, world and next step.
4. Shrink: the state that only the leavers hold is handed to the stayers over the old group,
   split evenly (:func:`hand_off`: one move of the same mechanism). Then the leavers leave.
5. The new generation forms its group (:func:`~minipar.runtime.rendezvous.form_group`). Every
   member builds the new world's layout and reshards into it from what it holds: a stayer from
   its old model's pieces and anything handed to it, a joiner from nothing (:class:`Holding`).

The data position is the step number, so the next step trains global batch ``step`` split over
the new dp, and the losses stay those of one process. Under ``torchrun`` a change of members is
a new rendezvous of its agents, which restart every worker (the process group is the agents'
round: ``tests/test_elastic.py``, from the last checkpoint); here the job keeps its store and makes
each generation's group itself, so only the joiner is a new process. Each member's record of a change holds the
generation, both worlds and layouts, the bytes moved and the seconds of every phase."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..moves import move
from ..pieces import local_pieces
from ..pieces.boxes import Piece
from ..runtime.rendezvous import connect, form_group
from .holdings import held_runs
from .switch import laid_end_to_end, reshard

KEY = "minipar/elastic"


@dataclass(frozen=True)
class Change:
    """What the members agreed after step ``step``: old ranks ``leavers`` leave, ``joiners`` join."""
    step: int
    generation: int           # the new generation's number
    world: int                # the old world
    leavers: tuple = ()
    joiners: int = 0

    @property
    def stayers(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.leavers]

    @property
    def new_world(self) -> int:
        return self.world - len(self.leavers) + self.joiners


class Holding:
    """What a rank holds between two process groups, as pieces (a joiner: none). It takes a
    model's place as :func:`~minipar.adapt.switch.reshard`'s ``old``."""
    optimizer = None

    def __init__(self, pieces=()):
        self.pieces = list(pieces)

    def held_pieces(self) -> list[Piece]:
        return self.pieces


class Member:
    """This process's place in the job: the store, its generation, rank, world and next step;
    ``joined``: the :class:`Change` that admitted it (``None``: one of the first ranks)."""

    def __init__(self, store, rank: int, world: int, generation: int = 0, step: int = 0,
                 timeout: float = 120.0, joined: Change | None = None):
        self.store, self.rank, self.world, self.generation = store, rank, world, generation
        self.step, self.timeout, self.joined = step, timeout, joined

    @classmethod
    def start(cls, address: str, rank: int, world: int, timeout: float = 120.0) -> "Member":
        """One of the job's first ``world`` ranks: generation 0."""
        store = connect(address, timeout)
        form_group(store, 0, rank, world, timeout=timeout)
        return cls(store, rank, world, 0, 0, timeout)

    @classmethod
    def join(cls, address: str, timeout: float = 120.0) -> "Member":
        """A new rank: wait (at most ``timeout`` s) until the running job admits it, then join its
        next generation's group."""
        store = connect(address, timeout)
        ticket = store.add(f"{KEY}/joiners", 1) - 1
        store.set(f"{KEY}/joiner/{ticket}", str(os.getpid()))
        try:
            store.wait([f"{KEY}/admit/{ticket}"], timedelta(seconds=timeout))
        except Exception as e:   # the store's own timeout error
            raise TimeoutError(f"joiner {ticket}: the job at {address} did not admit it within {timeout:g} s "
                               f"(finished, or never polls for joiners): {e}") from None
        a = json.loads(store.get(f"{KEY}/admit/{ticket}"))
        form_group(store, a["generation"], a["rank"], a["world"], timeout=timeout)
        return cls(store, a["rank"], a["world"], a["generation"], a["step"], timeout,
                   joined=Change(a["step"], a["generation"], a["from_world"], tuple(a["left"]), a["joined"]))

    def poll(self, step: int, leave: bool = False, joiners: str = "admit") -> Change | None:
        """After step ``step`` (counted from 1): the :class:`Change` every member agrees on, or
        ``None``. ``leave``: this rank asks to leave. ``joiners``: ``"admit"`` the joiners waiting,
        ``"wait"`` for one first (rank 0, at most the timeout), or ``"none"`` (not at this step).
        A collective of the members."""
        if joiners not in ("admit", "wait", "none"):
            raise ValueError(f"joiners={joiners!r}: one of 'admit', 'wait', 'none'")
        waiting = 0
        if self.rank == 0 and joiners != "none":
            admitted = self.store.add(f"{KEY}/admitted", 0)
            if joiners == "wait":
                try:
                    self.store.wait([f"{KEY}/joiner/{admitted}"], timedelta(seconds=self.timeout))
                except Exception as e:   # the store's own timeout error
                    raise TimeoutError(f"after step {step}: no rank came to join within {self.timeout:g} s "
                                       f"({e})") from None
            waiting = self.store.add(f"{KEY}/joiners", 0) - admitted
        wishes = [None] * self.world
        dist.all_gather_object(wishes, (step, bool(leave), waiting))
        if len({s for s, _, _ in wishes}) > 1:    # a member out of step: its data would be another batch
            raise RuntimeError(f"the members disagree on the step they finished: {[s for s, _, _ in wishes]}")
        change = Change(step, self.generation + 1, self.world, tuple(r for r, (_, go, _) in enumerate(wishes) if go),
                        wishes[0][2])
        if not change.leavers and not change.joiners:
            return None
        if change.new_world < 1:
            raise ValueError(f"after step {step} every rank asked to leave and no rank joins: nothing would train")
        return change

    def admit(self, change: Change) -> None:
        """Rank 0 tells each joiner its generation, rank, world and next step."""
        if self.rank != 0:
            return
        first = self.store.add(f"{KEY}/admitted", 0)
        for i in range(change.joiners):
            self.store.set(f"{KEY}/admit/{first + i}", json.dumps(
                {"generation": change.generation, "rank": len(change.stayers) + i, "world": change.new_world,
                 "step": change.step, "from_world": change.world, "left": list(change.leavers),
                 "joined": change.joiners}))
        self.store.add(f"{KEY}/admitted", change.joiners)

    def regroup(self, change: Change) -> None:
        """A stayer's rank in the new generation (the stayers keep their order), and its group."""
        self.rank, self.world = change.stayers.index(self.rank), change.new_world
        self.generation, self.step = change.generation, change.step
        form_group(self.store, self.generation, self.rank, self.world, timeout=self.timeout)


def change_members(hm, change: Change, member: Member, layout_of, build) -> tuple:
    """Carry out ``change`` on this old member holding the model ``hm`` (a collective of the old
    members, then of the new ones with the joiners' :func:`arrive`). ``layout_of(world)`` is the
    layout of a world, ``build(layout)`` its model. Returns ``(model, record)``: the new layout's
    model, or ``None`` on a rank that left."""
    phases, t = {}, time.perf_counter()
    member.admit(change)
    held, handed = (hand_off(hm, change) if change.leavers
                    else (Holding(local_pieces(hm, hm.optimizer)), {"handoff_bytes": 0}))
    dist.barrier()                   # every old member is done with the old group before it goes
    phases["hand_off"] = time.perf_counter() - t
    if member.rank in change.leavers:
        dist.destroy_process_group()
        return None, record(change, handed, {}, phases, layout_of)
    t = time.perf_counter()
    member.regroup(change)
    phases["group"] = time.perf_counter() - t
    new, moved = arrive(member, layout_of, build, held, phases)
    return new, record(change, handed, moved, phases, layout_of)


def arrive(member: Member, layout_of, build, held: Holding | None = None, phases: dict | None = None) -> tuple:
    """Build the new generation's layout and reshard into it from ``held`` (a joiner: nothing).
    Returns ``(model, the reshard's record)``; ``phases`` gains ``build`` and ``reshard``. A
    collective of the new generation."""
    phases = {} if phases is None else phases
    t = time.perf_counter()
    new = build(layout_of(member.world))
    phases["build"] = time.perf_counter() - t
    moved = reshard(held or Holding(), new)
    phases["reshard"] = moved["seconds"]
    return new, moved


def record(change: Change, handed: dict, moved: dict, phases: dict, layout_of) -> dict:
    """A member's record of ``change``: the generation, both worlds and layouts, bytes, seconds."""
    return {"step": change.step, "generation": change.generation, "from_world": change.world,
            "to_world": change.new_world, "from_layout": str(layout_of(change.world)),
            "to_layout": str(layout_of(change.new_world)), "left": list(change.leavers), "joined": change.joiners,
            "handoff_bytes": 0, **handed,
            **{k: moved[k] for k in ("bytes_sent", "bytes_received", "plan_bytes") if k in moved},
            "reshard_phases": moved.get("phases", {}),     # its wait: for the slowest member (a joiner's start)
            "seconds": sum(phases.values()), "phases": phases}


@torch.no_grad()
def hand_off(hm, change: Change) -> tuple[Holding | None, dict]:
    """On the old group: every element that only leavers hold moves to the stayers, split evenly
    among them (one move, :func:`minipar.moves.move`). Returns ``(holding, record)``: a stayer's
    holding is its model's pieces and the pieces handed to it; a leaver's is ``None``."""
    world, me = dist.get_world_size(), dist.get_rank()
    held, views, _ = held_runs(hm)
    everyone = [None] * world
    dist.all_gather_object(everyone, held)
    keys = sorted({k for ks, _, _ in everyone for k in ks})
    sizes = {k: int(np.prod(hm.full_shapes[k.split("/", 1)[1]])) for k in keys}
    offsets = np.concatenate([[0], np.cumsum(list(sizes.values()))]).astype(np.int64)
    runs = laid_end_to_end(everyone, sizes)
    stay = change.stayers
    lost = difference(np.concatenate([runs[r] for r in change.leavers]),
                      np.concatenate([runs[r] for r in stay]), offsets)
    parts = split(lost, len(stay))
    new = [parts[stay.index(r)] if r in stay else np.zeros((0, 2), np.int64) for r in range(world)]
    device = hm.device
    mine = [v for k in sizes if k in views for v in views[k]]
    flat_old = torch.cat(mine) if mine else torch.empty(0, dtype=torch.float32, device=device)
    flat_new = torch.empty(int(new[me][:, 1].sum()), dtype=torch.float32, device=device)
    out = move(runs, new, flat_old, flat_new, name="hand_off")
    handed = {"handoff_bytes": 4 * int(sum(out["sent"])), "handoff_received": 4 * int(out["received"][me])}
    if me in change.leavers:
        return None, handed
    pieces, at, names = local_pieces(hm, hm.optimizer), 0, list(sizes)
    for start, n in new[me]:
        k = int(np.searchsorted(offsets, start, "right")) - 1
        slot, name = names[k].split("/", 1)
        shape, lo = tuple(hm.full_shapes[name]), int(start - offsets[k])
        pieces.append(Piece(name, slot, shape, (0,) * len(shape), shape, lo, lo + int(n), flat_new[at:at + n]))
        at += int(n)
    return Holding(pieces), handed


def covered(runs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Whether each point of ``x`` lies in one of ``runs`` (``[[start, length], ...]``, any order)."""
    starts, ends = np.sort(runs[:, 0]), np.sort(runs.sum(1))
    return np.searchsorted(starts, x, "right") - np.searchsorted(ends, x, "right") > 0


def difference(a: np.ndarray, b: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """The elements of runs ``a`` in no run of ``b``, as runs, cut at every point of ``cuts``
    (the keys' offsets: no run spans two tensors)."""
    if not len(a):
        return a.reshape(0, 2)
    points = np.unique(np.concatenate([a[:, 0], a.sum(1), b[:, 0], b.sum(1), cuts]))
    lo, n = points[:-1], np.diff(points)
    keep = covered(a, lo) & ~(covered(b, lo) if len(b) else np.zeros(len(lo), bool))
    return np.stack([lo[keep], n[keep]], 1).astype(np.int64)


def split(runs: np.ndarray, k: int) -> list[np.ndarray]:
    """``runs`` cut into ``k`` consecutive parts of (nearly) equal element counts."""
    ends = np.cumsum(runs[:, 1])
    starts, total = ends - runs[:, 1], int(ends[-1]) if len(ends) else 0
    out = []
    for a, b in zip([total * i // k for i in range(k)], [total * (i + 1) // k for i in range(k)]):
        lo, hi = np.maximum(starts, a), np.minimum(ends, b)
        m = hi > lo
        out.append(np.stack([runs[m, 0] + (lo - starts)[m], (hi - lo)[m]], 1).astype(np.int64))
    return out
