"""Run a schedule on paper: the ideal timeline, deadlock-freedom, stash sizes, bubbles.

:func:`simulate` executes a :class:`~minipar.pipeline.schedules.Schedule` as the real
executor would, with fixed costs instead of a model: each rank walks its action list; a
compute takes ``f``, ``b`` or ``w`` time units (times the stage's weight); a send is
posted and never blocks; a receive blocks until the matching send happened plus
``comm`` units. It returns a :class:`minipar.runtime.trace.Trace` with the same events as a
measured run (one time unit is drawn as 1 ms), so ``minipar.runtime.viz.timeline`` draws both.

If at some point every unfinished rank waits in a receive whose send is never reached,
the schedule deadlocks: :func:`simulate` raises :class:`Deadlock` naming the stuck actions.
:func:`check_schedule` adds the other proofs of a valid schedule.

:func:`bubble` is the theoretical bubble, relative to the ideal time (Narayanan et al.
2021): for a rank that computes for ``c`` of a step's ``T`` time units, ``(T - c) / c``;
GPipe and 1F1B give ``(p-1)/m`` when every stage costs the same
(:func:`minipar.cost.bubble_fraction` has the formulas). The bubble of a measured run,
with the same definition (``c`` the union of the rank's compute intervals), is the
trace's own (:class:`minipar.runtime.trace.Trace`).
"""
from __future__ import annotations

from itertools import accumulate

from ..runtime.trace import Trace
from .schedules import COMPUTE, Schedule, message

NAMES = {"F": "forward", "B": "backward", "W": "weight-grad"}
UNIT = 1e-3  # seconds per simulated time unit: the timeline's "ms" axis reads in units


class Deadlock(RuntimeError):
    """Every unfinished rank waits for a message that is never sent."""


def simulate(schedule: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0,
             comm: float = 0.0, stage_weights: list[float] | None = None) -> Trace:
    """The timeline of ``schedule`` with forward cost ``f``, backward ``b + w`` (split into
    B = ``b`` and W = ``w`` when the schedule has W actions), per-stage multipliers
    ``stage_weights`` (default ``1/v``: a virtual stage holds 1/v of a rank's layers)."""
    S, split, p = schedule.n_stages, schedule.split_backward, schedule.p
    weights = stage_weights or [1.0 / schedule.v] * S
    if len(weights) != S:
        raise ValueError(f"stage_weights has {len(weights)} entries for {S} stages")
    cost = {"F": f, "B": b if split else b + w, "W": w}
    sent, pos, clock, events = {}, [0] * p, [0.0] * p, [[] for _ in range(p)]  # sent: message -> time
    while True:
        progress = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.op.startswith("RECV"):
                    if message(a) not in sent:
                        break
                    clock[r] = max(clock[r], sent[message(a)] + comm)
                elif a.op.startswith("SEND"):
                    sent[message(a)] = clock[r]
                else:
                    t = cost[a.op] * weights[a.stage]
                    labels = {"microbatch": a.microbatch, "stage": a.stage, "phase": a.op}
                    events[r].append({"rank": r, "kind": "compute", "name": NAMES[a.op],
                                      "start": clock[r] * UNIT, "end": (clock[r] + t) * UNIT,
                                      "bytes_sent": 0, "bytes_recv": 0, "labels": labels})
                    clock[r] += t
                pos[r] += 1
                progress = True
        if all(pos[r] == len(acts) for r, acts in enumerate(schedule.actions)):
            return Trace(events)
        if not progress:
            stuck = {r: acts[pos[r]] for r, acts in enumerate(schedule.actions) if pos[r] < len(acts)}
            raise Deadlock(f"{schedule} deadlocks: " + ", ".join(f"rank {r} waits in {a}"
                                                                 for r, a in stuck.items()))


def check_schedule(schedule: Schedule) -> None:
    """Raise ``AssertionError``/:class:`Deadlock` unless ``schedule`` is valid: each (micro-batch,
    stage) has one F, one B (and one W if the backward is split) on the stage's rank, F before B
    before W; every send has one receive on its peer, each channel (sender, receiver, kind)
    delivering in the order it is read; and the simulation finishes (no deadlock)."""
    p, S, m = schedule.p, schedule.n_stages, schedule.m
    ops = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    seen, sends, recvs = {}, {}, {}  # (op, i, s) -> position; channel -> messages sent / received
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            assert a.stage % p == r, f"{a} on rank {r}, but stage {a.stage} lives on rank {a.stage % p}"
            assert 0 <= a.microbatch < m and 0 <= a.stage < S, f"{a} out of range"
            if a.op in COMPUTE:
                assert (a.op, a.microbatch, a.stage) not in seen, f"{a} appears twice on rank {r}"
                seen[a.op, a.microbatch, a.stage] = k
            elif a.op.startswith("SEND"):
                sends.setdefault((r, a.peer, a.op[-1]), []).append(message(a))
            else:
                recvs.setdefault((a.peer, r, a.op[-1]), []).append(message(a))
    for i in range(m):
        for s in range(S):
            for op in ops:
                assert (op, i, s) in seen, f"{op}{i} on stage {s} is missing"
            for a, b in zip(ops, ops[1:]):
                assert seen[a, i, s] < seen[b, i, s], f"{b}{i} before {a}{i} on stage {s}"
    assert set(sends) == set(recvs), f"channels with sends but no receives: {set(sends) ^ set(recvs)}"
    for ch, msgs in sends.items():
        assert msgs == recvs[ch], f"channel {ch}: sent {msgs} but received {recvs[ch]}"
    simulate(schedule)


def peak_stash(schedule: Schedule) -> list[int]:
    """Per rank, the most micro-batches whose tensors the rank holds at once under ``schedule``:
    what :class:`~minipar.pipeline.executor.Pipeline`'s ``peak_stash`` must read after a step
    (notebook 04 compares it with 1F1B's bound)."""
    free = "W" if schedule.split_backward else "B"   # held: +1 at each F, -1 at each freeing action
    return [max([0, *accumulate((a.op == "F") - (a.op == free) for a in schedule.compute(r))])
            for r in range(schedule.p)]


def bubble(schedule: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0,
           stage_weights: list[float] | None = None) -> list[float]:
    """Per rank ``(T - c) / c`` in the ideal timeline of ``schedule`` (:func:`simulate`
    with these costs): idle time over busy time, ``T`` the step's span over all ranks."""
    evs = simulate(schedule, f, b, w, comm, stage_weights).ranks
    T = max(e["end"] for r in evs for e in r) - min(e["start"] for r in evs for e in r)
    busy = [sum(e["end"] - e["start"] for e in r) for r in evs]   # a simulated rank never overlaps itself
    return [(T - c) / c if c else float("inf") for c in busy]


def compute_only(trace: Trace) -> Trace:
    """The trace without communication events (what :func:`simulate` draws)."""
    return Trace([[e for e in evs if e["kind"] == "compute"] for evs in trace.ranks])
