"""Per-rank event traces: what each rank computed, communicated, and when.

Every rank keeps its events in its own process, each a dict::

    {"rank": 0, "kind": "compute" | "comm" | "staging", "name": "forward", "start": 0.012, "end": 0.034,
     "bytes_sent": 0, "bytes_recv": 0, "labels": {"layer": 3, "microbatch": 1}}

Times are seconds since :func:`start`, which every rank calls right after a barrier, so the
ranks share one time axis. Idle time is not recorded: it is the part of a rank's span that no
event covers (:meth:`Trace.summary`). Communication events carry ``labels["dim"]``, the mesh
dimension of their group ("dp", "tp", "pp", ...; :func:`minipar.comm.name_group`), so bytes
add up by dimension without reading event names (:func:`bytes_by_dim`). One step's events:
``m = trace.mark()``, run the step, ``trace.since(m)``. A ``staging`` event is a message's copy
through host memory (:mod:`minipar.runtime.staging`): time spent communicating, but not an
operation of its own (counts of ``comm`` events are counts of operations). ``minipar.runtime.launch`` starts the recorder
in every rank and returns the events as ``results.trace``, a :class:`Trace` for :mod:`minipar.runtime.viz`.
The recorder keeps a ring of the last :data:`LIMIT` events, so a long run's memory stays flat
(:func:`set_limit`, :func:`dropped`, :func:`recording`); ``python -m minipar.train`` records nothing."""
from __future__ import annotations

import time
from contextlib import contextmanager
from itertools import islice

_events: list[dict] = []
_t0: float = time.perf_counter()
_rank: int = 0
_enabled: bool = True
_origin: float | None = None
_recorded: int = 0  # events recorded since start(): what mark() counts
LIMIT = 200_000  # events kept per rank (a few hundred bytes each): the ring's default size
_limit: int | None = LIMIT


def set_origin(t: float | None) -> None:
    """Share one time zero between the processes of one machine (``time.perf_counter`` is
    the same system-wide clock in all of them); ``minipar.runtime.launch`` passes its own."""
    global _origin
    _origin = t


def start(rank: int = 0, barrier: bool = True) -> None:
    """Clear the recorder and set time zero: the shared origin when there is one, else
    the moment a barrier releases the ranks (several machines under torchrun)."""
    global _t0, _rank, _recorded
    import torch.distributed as dist
    _events.clear()
    _recorded, _rank = 0, rank
    if _origin is None and barrier and dist.is_initialized():
        dist.barrier()
    _t0 = time.perf_counter() if _origin is None else _origin


def now() -> float:
    """Seconds since :func:`start` on this rank."""
    return time.perf_counter() - _t0


def enable(flag: bool = True) -> None:
    """Turn recording on or off (off makes :func:`record` a no-op)."""
    global _enabled
    _enabled = flag


def recording_on() -> bool:
    """Whether :func:`record` keeps events now (:func:`enable`, :func:`recording`)."""
    return _enabled


RESERVED = {
    "dim": "the mesh dimension of the event's group: set by minipar.comm from the group's name "
           "(comm.name_group), unless the caller names one",
    "staged": "the operation a host copy serves: set by minipar.runtime.staging on its own events",
}  # label keys the library writes itself; a caller's labels may not use "staged"


def record(kind: str, name: str, start: float, end: float, bytes_sent: int = 0,
           bytes_recv: int = 0, labels: dict | None = None, op: str | None = None,
           group: tuple[int, ...] | None = None) -> None:
    """Append one event; ``start``/``end`` come from :func:`now`. ``labels`` is the event's one
    record of labels (a dict, kept as given: never spread into keywords, so no label can
    collide with this function's own parameters or with a key the library adds, :data:`RESERVED`).
    A ``comm`` event from :mod:`minipar.comm` also has its ``op`` (``all_reduce``,
    ``reduce_scatter``, ``all_gather``, ``all_to_all``, ``send``, ``recv``, ``exchange``) and its
    ``group``: the global ranks it ran on, in group-rank order."""
    global _recorded
    if _enabled:
        _recorded += 1
        event = {"rank": _rank, "kind": kind, "name": name, "start": start, "end": end,
                 "bytes_sent": int(bytes_sent), "bytes_recv": int(bytes_recv),
                 "labels": {} if labels is None else labels}
        if op is not None:
            event["op"] = op
        if group is not None:
            event["group"] = list(group)
        _events.append(event)
        if _limit is not None and len(_events) > _limit + _limit // 8:
            del _events[:len(_events) - _limit]  # drop the oldest, an eighth at a time


def set_limit(n: int | None = LIMIT) -> None:
    """Keep at most the last ``n`` events of this rank (``None``: no bound)."""
    global _limit
    if n is not None and n < 1:
        raise ValueError(f"the trace limit must be a positive number of events, got {n}")
    _limit = n
    if n is not None and len(_events) > n:
        del _events[:len(_events) - n]


def dropped() -> int:
    """How many of the events recorded since :func:`start` the ring no longer holds."""
    return _recorded - len(_events)


@contextmanager
def recording(flag: bool = True):
    """Record (``flag=True``) or not (``False``) inside the block, then restore what was:
    ``with trace.recording(False): train(...)`` keeps a long run's trace empty."""
    global _enabled
    before, _enabled = _enabled, flag
    try:
        yield
    finally:
        _enabled = before


@contextmanager
def region(name: str, kind: str = "compute", **labels):
    """Record the enclosed block as one event: ``with trace.region("forward", layer=2): ...``.
    On a GPU the block's kernels are waited for at both ends (:func:`synchronize_on`), so
    the event spans the work, not the host's queueing of it; with recording off
    (:func:`recording`) a region neither waits nor records: the block runs as it would bare."""
    if not _enabled:
        yield
        return
    _sync()
    t = now()
    try:
        yield
    finally:
        _sync()
        record(kind, name, t, now(), labels=labels)


def _no_sync() -> None:
    """On the CPU a region waits for nothing (:func:`synchronize_on` sets the GPU's wait)."""


_sync = _no_sync


def synchronize_on(device) -> None:
    """Make regions wait for ``device``'s current CUDA stream (``minipar.runtime.launch`` calls this
    in ranks placed on a GPU; a CPU device turns it off). CUDA kernels run asynchronously:
    without this a region would end when its kernels were queued."""
    global _sync
    import torch
    dev = torch.device(device)
    _sync = (lambda: torch.cuda.current_stream(dev).synchronize()) if dev.type == "cuda" else _no_sync


def events() -> list[dict]:
    """A copy of this rank's events so far."""
    return [dict(e) for e in _events]


def mark() -> int:
    """A position in this rank's trace: :func:`since` returns what was recorded after it."""
    return _recorded


def since(position: int) -> list[dict]:
    """Copies of the events recorded after :func:`mark` returned ``position`` (only those:
    the rest of a long trace is not copied)."""
    n = min(_recorded - position, len(_events))
    return [dict(e) for e in islice(_events, len(_events) - n, None)] if n > 0 else []


def bytes_by_dim(events) -> dict:
    """``{dim: bytes sent}`` of the communication ``events``, by their ``dim`` label, plus
    ``"total"``; a dimension missing from the events counts 0 there."""
    out: dict = {}
    for e in events:
        if e["kind"] == "comm":
            d = e["labels"].get("dim")
            out[d] = out.get(d, 0) + e["bytes_sent"]
    out["total"] = sum(out.values())
    return out


def backward(loss, **labels) -> None:
    """``loss.backward()``, recorded as one ``backward`` compute event that ends when
    autograd has computed the last gradient: before the callbacks queued later in the same
    pass (such as DDP's wait for its last all-reduces), which are not computation. With
    recording off: only ``loss.backward()`` (no wait for the GPU, no hook)."""
    import torch
    if not _enabled:
        loss.backward()
        return
    _sync()
    t, end = now(), []
    if loss.requires_grad:  # the loss's own gradient comes first: queue our callback first
        loss.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(
            lambda: (_sync(), end.append(now()))))  # on a GPU: when its kernels finished
    loss.backward()
    record("compute", "backward", t, end[0] if end else now(), labels=labels)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reached = 0.0, float("-inf")
    for s, e in sorted(intervals):  # by start: add what each interval covers beyond the last end
        if e > reached:
            total, reached = total + e - max(s, reached), e
    return total


class Trace:
    """The events of all ranks of one run, ``trace.ranks[r]`` a list of event dicts."""

    def __init__(self, ranks: list[list[dict]]):
        self.ranks = ranks

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def events(self, kind: str | None = None, name: str | None = None) -> list[dict]:
        """All events (optionally one kind or name), every rank, in start order."""
        out = [e for evs in self.ranks for e in evs
               if (kind is None or e["kind"] == kind) and (name is None or e["name"] == name)]
        return sorted(out, key=lambda e: (e["start"], e["rank"]))

    def bytes_by_dim(self, rank: int) -> dict:
        """Bytes rank ``rank`` sent, by mesh dimension (:func:`bytes_by_dim`)."""
        return bytes_by_dim(self.ranks[rank])

    def bubble(self) -> list[float]:
        """The measured pipeline bubble, per rank ``(T - c) / c``: idle time relative to the
        busy time, ``T`` the span of all ranks' compute events, ``c`` the length of the union
        of this rank's compute events (nested regions count once; communication is not
        work). GPipe and 1F1B give ``(p-1)/m`` with equal stages (Narayanan et al. 2021)."""
        spans = [(e["start"], e["end"]) for evs in self.ranks for e in evs if e["kind"] == "compute"]
        T = max(e for _, e in spans) - min(s for s, _ in spans)
        cs = [_union_length([(e["start"], e["end"]) for e in evs if e["kind"] == "compute"])
              for evs in self.ranks]
        return [(T - c) / c if c > 0 else float("inf") for c in cs]

    def bytes_sent(self, rank: int, name: str | None = None) -> int:
        """Bytes rank ``rank`` sent (optionally in operations called ``name`` only)."""
        return sum(e["bytes_sent"] for e in self.ranks[rank] if name is None or e["name"] == name)

    def summary(self) -> list[dict]:
        """Per rank: span, compute, comm, idle seconds and bytes sent/received. ``compute`` and ``comm``
        are the lengths of the union of their events (nested regions count once; ``comm`` covers
        the host copies of staged messages too, ``staging`` events); ``overlap`` is
        time covered by both (communication hidden behind compute); ``idle = span - |compute ∪ comm|``."""
        spans = [(e["start"], e["end"]) for evs in self.ranks for e in evs]
        span = max((e for _, e in spans), default=0.0) - min((s for s, _ in spans), default=0.0)
        rows = []
        for r, evs in enumerate(self.ranks):
            comp = [(e["start"], e["end"]) for e in evs if e["kind"] == "compute"]
            comm = [(e["start"], e["end"]) for e in evs if e["kind"] in ("comm", "staging")]
            c, m, busy = _union_length(comp), _union_length(comm), _union_length(comp + comm)
            rows.append({"rank": r, "span": span, "compute": c, "comm": m, "overlap": c + m - busy,
                         "idle": span - busy, "bytes_sent": sum(e["bytes_sent"] for e in evs),
                         "bytes_recv": sum(e["bytes_recv"] for e in evs)})
        return rows

    def __repr__(self) -> str:
        return f"Trace({self.world_size} ranks, {sum(len(e) for e in self.ranks)} events)"
