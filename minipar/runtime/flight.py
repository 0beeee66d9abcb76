"""A flight recorder of the operations each rank started, and a watchdog that names them when
a run hangs (in the spirit of PyTorch's NCCL flight recorder).

Every communication :mod:`minipar.comm` starts is noted in a small ring: the operation
(``all_reduce``, ``send``...), its name, the group's mesh dimension (``dp``, ``tp``, ...), the
**sequence number** of the operation on that group, when it started and, once waited for, when
it ended. A counter and a dict per operation, the last :data:`RING` kept: it is always on.

A hang leaves a signature in those records. When one rank is stuck *before* a collective, its
peers wait *inside* it: they started operation ``N`` on the group, the stuck rank finished
``N - 1`` and never started ``N``. :class:`Watchdog` is a thread that notices when its rank
made no progress (no operation started or finished, no :func:`beat`) for ``timeout`` seconds
once armed (:func:`arm`); it shares its last record with the other ranks through the
rendezvous store, prints every rank's last record and ends the process with :data:`EXIT_HUNG`.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque

RING = 64          # entries kept per rank
EXIT_HUNG = 124    # the exit code of a rank the watchdog stopped (as coreutils' timeout)

_ring: deque = deque(maxlen=RING)
_seq: dict = {}
_progress = time.monotonic()
_armed = False  # the watchdog counts only once the work it watches has begun (arm())
_next_detail: dict | None = None  # detail() for the next operation started


def detail(**kw) -> None:
    """Detail (``step=``, ``phase=``, ``peers=``) for the next operation :func:`started` notes
    (a check just before an operation knows what the operation's own caller does not pass)."""
    global _next_detail
    _next_detail = kw


def started(op: str, name: str | None = None, dim: str | None = None, **detail) -> dict:
    """Note that ``op`` (called ``name``) started on the group of dimension ``dim``; ``detail``
    (``step=``, ``phase=``, ``peers=``) is kept for the hang report."""
    global _progress, _next_detail
    _seq[dim] = seq = _seq.get(dim, 0) + 1
    _progress = t = time.monotonic()
    if _next_detail is not None:  # what a check just before this operation knew about it
        detail, _next_detail = {**_next_detail, **detail}, None
    entry = {"op": op, "name": name or op, "dim": dim, "seq": seq, "start": t, "end": None, **detail}
    _ring.append(entry)
    return entry


def completed(entry: dict | None, pending=None) -> None:
    """Note that the operation of ``entry`` (from :func:`started`) finished, or, with
    ``pending`` (a callable that says whether the device finished it: a CUDA event's
    ``query``), that the host waited for it while the device may still run it (NCCL)."""
    global _progress
    _progress = t = time.monotonic()
    if entry is not None:
        if pending is None:
            entry["end"] = t
        else:
            entry["pending"] = pending


def finished(entry: dict) -> bool:
    """Whether the operation of ``entry`` finished (on the device, for NCCL work)."""
    if entry["end"] is None and entry.get("pending") is not None and entry["pending"]():
        entry["end"], entry["pending"] = time.monotonic(), None
    return entry["end"] is not None


def beat() -> None:
    """Progress that is not communication (a step finished): the watchdog waits again."""
    global _progress
    _progress = time.monotonic()


def arm() -> None:
    """From now on a :class:`Watchdog` may fire (call it where the watched loop starts, so
    that building a model or loading a checkpoint, however slow, never counts as a hang)."""
    global _armed
    beat()
    _armed = True


def entries() -> list[dict]:
    """Copies of the recorded operations, oldest first."""
    return [dict(e) for e in _ring]


def reset() -> None:
    """Forget everything (a new run): sequence numbers start again at 1."""
    global _progress, _armed
    _ring.clear()
    _seq.clear()
    _progress, _armed = time.monotonic(), False


def describe(entry: dict | None, now: float | None = None) -> str:
    """One line: what the operation was and whether the rank is still inside it."""
    if entry is None:
        return "no collective started yet"
    now = time.monotonic() if now is None else now
    what = f"{entry['op']} {entry['name']!r} on {entry['dim'] or 'an unnamed group'} (seq {entry['seq']})"
    if not finished(entry):
        return f"{what}, waiting inside it for {now - entry['start']:.1f} s"
    return (f"{what}, finished {now - entry['end']:.1f} s ago; not in a collective "
            "(stuck before its next one)")


def _summary(rank: int, now: float) -> dict:
    last = _ring[-1] if _ring else None
    per_group = {e["dim"]: e for e in _ring}  # the last entry of each group
    where = ", ".join(f"{d or 'unnamed'} seq {e['seq']} {'finished' if finished(e) else 'waiting'}"
                      for d, e in per_group.items())
    return {"rank": rank, "line": describe(last, now) + (f"; last on each group: {where}" if where else "")}


def _share(summary: dict, grace: float) -> list[dict]:
    """Every rank's summary, exchanged through the rendezvous store (only this rank's if the
    store is unreachable or a rank does not answer within ``grace`` seconds)."""
    import torch.distributed as dist
    try:
        store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no process group: report this rank alone
        return [summary]
    prefix = f"minipar/flight/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store.set(prefix + str(summary["rank"]), json.dumps(summary))
        out, deadline = {}, time.monotonic() + grace
        while len(out) < world and time.monotonic() < deadline:
            for r in range(world):
                if r not in out and store.check([prefix + str(r)]):
                    out[r] = json.loads(store.get(prefix + str(r)))
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went away: what we have
        return [summary]
    return [out.get(r, {"rank": r, "line": "did not report (dead, or stuck holding the interpreter)"})
            for r in range(world)]


def report(rank: int, timeout: float, grace: float = 5.0) -> str:
    """The hang report: which collective every rank started last, and where it is now."""
    rows = _share(_summary(rank, time.monotonic()), grace)
    lines = [f"minipar: rank {rank} made no progress for {timeout:g} s (the hang timeout); "
             "the last collective each rank started:"]
    lines += [f"  rank {r['rank']}: {r['line']}" for r in rows]
    lines.append("A rank that finished the previous operation and never started the one its peers "
                 "wait in is the one stuck (or it called another collective than they did).")
    return "\n".join(lines)


class Watchdog:
    """``with Watchdog(timeout, rank): ...``: stop this process with :data:`EXIT_HUNG` and a
    :func:`report` (to the process's real stderr, or appended to the file ``log``) when it
    makes no progress for ``timeout`` seconds (``0``: never)."""

    def __init__(self, timeout: float, rank: int = 0, exit_code: int = EXIT_HUNG, log=None):
        self.timeout, self.rank, self.exit_code, self.log = timeout, rank, exit_code, log
        self._stop, self._thread = threading.Event(), None

    def __enter__(self):
        beat()
        if self.timeout and self.timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="minipar-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if _armed and time.monotonic() - _progress > self.timeout:
                text = report(self.rank, self.timeout, grace=min(10.0, max(2.0, self.timeout)))
                if self.rank != 0:  # rank 0 prints every rank's line; the others their own
                    text = "\n".join(line for line in text.splitlines()
                                     if not line.startswith("  rank ") or
                                     line.startswith(f"  rank {self.rank}:"))
                if self.log is None:
                    print(text, file=sys.__stderr__, flush=True)
                else:
                    with open(self.log, "a") as f:
                        f.write(text + "\n")
                os._exit(self.exit_code)


def _line(entry: dict | None) -> str:
    """The operation, its step and peers where known, and whether the rank is still inside it
    (no durations: the line is read later, by another process)."""
    if entry is None:
        return "no collective started yet"
    extra = "".join(f", {k} {entry[k]}" for k in ("phase", "step", "peers") if entry.get(k) is not None)
    what = f"{entry['op']} {entry['name']!r} on {entry['dim'] or 'an unnamed group'} (seq {entry['seq']}{extra})"
    return what + (": still inside it" if entry["end"] is None
                   else ": finished it, and never started the next one")


class Beacon:
    """``with Beacon(path, rank): ...``: a daemon thread that keeps ``path`` (JSON) holding this
    rank's last recorded operations, rewritten at most every ``every`` seconds when they
    changed. A driver that gave up waiting (a hang) reads every rank's file to say where each
    one was stuck, although the ranks themselves never returned. Costs one small write per
    change, off the rank's own thread; :mod:`minipar.course.grade` turns it on."""

    def __init__(self, path, rank: int, every: float = 0.5):
        self.path, self.rank, self.every = str(path), rank, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minipar-flight-beacon", daemon=True)

    def __enter__(self):
        reset()  # this job's operations only (a pool worker runs many)
        self._write()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._write()
        return False

    def _write(self) -> None:
        last = dict(_ring[-1]) if _ring else None
        per_group = {e["dim"]: e for e in list(_ring)}
        data = {"rank": self.rank, "line": _line(last),
                "groups": {str(d): f"seq {e['seq']} {'waiting' if e['end'] is None else 'finished'}"
                           for d, e in per_group.items()}}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)

    def _run(self) -> None:
        seen = None
        while not self._stop.wait(self.every):
            key = (len(_ring), _progress)
            if key != seen:
                seen = key
                try:
                    self._write()
                except OSError:
                    return
