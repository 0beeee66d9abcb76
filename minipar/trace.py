"""Per-rank event traces: what each rank computed, communicated, and when.

Every rank keeps a list of events in its own process. An event is a dict::

    {"rank": 0, "kind": "compute" | "comm", "name": "forward", "start": 0.012, "end": 0.034,
     "bytes_sent": 0, "bytes_recv": 0, "labels": {"layer": 3, "microbatch": 1}}

Times are seconds since :func:`start`, which every rank calls right after a barrier, so
the ranks share one time axis. Idle time is not recorded: it is the time in a rank's
span covered by no event (see :meth:`Trace.summary`).

``minipar.launch`` starts the recorder in every rank and brings the events back as
``results.trace``, a :class:`Trace` that :mod:`minipar.viz` draws.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

_events: list[dict] = []
_t0: float = time.perf_counter()
_rank: int = 0
_enabled: bool = True
_origin: float | None = None


def set_origin(t: float | None) -> None:
    """Share one time zero between the processes of one machine (``time.perf_counter`` is
    the same system-wide clock in all of them); ``minipar.launch`` passes its own."""
    global _origin
    _origin = t


def start(rank: int = 0, barrier: bool = True) -> None:
    """Clear the recorder and set time zero: the shared origin when there is one, else
    the moment a barrier releases the ranks (several machines under torchrun)."""
    global _t0, _rank
    import torch.distributed as dist
    _events.clear()
    _rank = rank
    if _origin is not None:
        _t0 = _origin
        return
    if barrier and dist.is_initialized():
        dist.barrier()
    _t0 = time.perf_counter()


def now() -> float:
    """Seconds since :func:`start` on this rank."""
    return time.perf_counter() - _t0


def enable(flag: bool = True) -> None:
    """Turn recording on or off (off makes :func:`record` a no-op)."""
    global _enabled
    _enabled = flag


def record(kind: str, name: str, start: float, end: float, bytes_sent: int = 0,
           bytes_recv: int = 0, **labels) -> None:
    """Append one event; ``start``/``end`` come from :func:`now`."""
    if _enabled:
        _events.append({"rank": _rank, "kind": kind, "name": name, "start": start, "end": end,
                        "bytes_sent": int(bytes_sent), "bytes_recv": int(bytes_recv),
                        "labels": labels})


@contextmanager
def region(name: str, kind: str = "compute", **labels):
    """Record the enclosed block as one event: ``with trace.region("forward", layer=2): ...``."""
    t = now()
    try:
        yield
    finally:
        record(kind, name, t, now(), **labels)


def events() -> list[dict]:
    """A copy of this rank's events so far."""
    return [dict(e) for e in _events]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
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

    def bytes_sent(self, rank: int, name: str | None = None) -> int:
        """Bytes rank ``rank`` sent (optionally in operations called ``name`` only)."""
        return sum(e["bytes_sent"] for e in self.ranks[rank]
                   if name is None or e["name"] == name)

    def summary(self) -> list[dict]:
        """Per rank: span, compute, comm, idle seconds and bytes sent/received.

        ``compute`` and ``comm`` are the lengths of the union of their events (nested
        regions are not counted twice); ``overlap`` is time covered by both (communication
        hidden behind compute); ``idle = span - |compute ∪ comm|``.
        """
        rows = []
        spans = [(e["start"], e["end"]) for evs in self.ranks for e in evs]
        t_begin = min((s for s, _ in spans), default=0.0)
        t_end = max((e for _, e in spans), default=0.0)
        for r, evs in enumerate(self.ranks):
            comp = [(e["start"], e["end"]) for e in evs if e["kind"] == "compute"]
            comm = [(e["start"], e["end"]) for e in evs if e["kind"] == "comm"]
            c, m, busy = _union_length(comp), _union_length(comm), _union_length(comp + comm)
            rows.append({"rank": r, "span": t_end - t_begin, "compute": c, "comm": m,
                         "overlap": c + m - busy, "idle": (t_end - t_begin) - busy,
                         "bytes_sent": sum(e["bytes_sent"] for e in evs),
                         "bytes_recv": sum(e["bytes_recv"] for e in evs)})
        return rows

    def __repr__(self) -> str:
        n = sum(len(e) for e in self.ranks)
        return f"Trace({self.world_size} ranks, {n} events)"
