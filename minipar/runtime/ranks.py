"""Ranks that stay: ``Ranks(4)`` starts 4 ranks that run cell after cell, each keeping its own variables.

``launch`` runs one function on fresh ranks and returns; :class:`Ranks` keeps the ranks alive
between calls, for a notebook (the ``%%ranks`` magic, :mod:`minipar.course.magic`) where one
cell builds a model on every rank and the next looks at rank 2's shard. It is made of the
runtime's own pieces: the placement of :func:`~minipar.runtime.backend.place` (NCCL with a GPU
per rank, ranks sharing a GPU over Gloo, Gloo on the CPU), the rendezvous store, the
forkserver of the pool, the rank setup of the course's exercises, the trace and the flight
recorder. The ranks' loop is :mod:`minipar.runtime.rank_loop`.

:meth:`Ranks.run` sends a cell's source to every rank and waits for all of them. When one
raises, the others get ``grace`` seconds to finish the cell; a rank still running after that
(waiting for the one that failed), or any rank still running after ``timeout`` (a hang), is
asked where it is (:meth:`Ranks.where`: the operation it last started and the cell line it
is on) and the ranks are restarted: a collective cannot be taken back, so fresh ranks, with
fresh namespaces, are the clean way on. A rank ends by itself when the driver goes away.
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import cloudpickle

from . import rank_loop, rank_setup
from . import trace as _trace
from .backend import default_device, place
from .pool import IN_RANK, cell_sources, context, loopback, main_not_reimported
from .pool import stop as stop_workers
from .rendezvous import STARTUP, serve_store

__all__ = ["Ranks", "RanksError", "Outcome", "current", "start", "stop"]


class RanksError(RuntimeError):
    """The ranks could not start, or a request to them failed (the message says which rank)."""


@dataclass
class Outcome:
    """What a cell did on every rank. ``replies[r]``: ``{"out", "value", "figure", "error",
    "exc", "line"}`` (``None`` for a rank that never answered); ``problem``: ``None``,
    ``"error"``, ``"hang"``, ``"died"`` or ``"interrupted"``; ``where[r]``: :meth:`Ranks.where`
    of every rank when the cell did not end by itself; ``restarted``: fresh ranks now."""

    cell: int
    source: str
    replies: list
    problem: str | None = None
    where: list = field(default_factory=list)
    restarted: bool = False
    seconds: float = 0.0
    timeout: float = 0.0
    note: str = ""  # what happened before the cell ran (ranks found dead, restarted)

    def failed(self) -> list[int]:
        return [r for r, x in enumerate(self.replies) if x is not None and x.get("error")]


class Ranks:
    """``n`` persistent ranks, placed as ``launch`` places them (``device``, ``backend``)."""

    def __init__(self, n: int, device: str | None = None, backend: str = "auto", threads: int = 1,
                 start_timeout: float = STARTUP):
        if os.environ.get(IN_RANK):
            raise RuntimeError("ranks are started from the driver (the notebook), not inside a rank")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"the number of ranks must be a positive int, got {n!r}")
        self.world_size, self.device, self.backend, self.threads = n, device or default_device(), backend, threads
        self.placement = place(n, self.device, backend)
        self.start_timeout, self.cells = start_timeout, itertools.count(1)
        self.sources: dict[int, str] = {}
        self._start()

    # ------------------------------------------------------------------ processes
    def _start(self) -> None:
        n, ctx = self.world_size, context()
        self.store, port = serve_store(n, self.start_timeout)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n)}
        if loopback():
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = loopback()
        job = {"port": port, "backend": self.placement.backend, "world_size": n, "env": env,
               "devices": [str(self.placement.device_for_rank(r)) for r in range(n)],
               "threads": self.threads, "sys_path": list(sys.path), "driver_pid": os.getpid(),
               "t0": time.perf_counter()}
        self.procs, self.cmd, self.ctl = [], [], []
        with main_not_reimported():
            for r in range(n):
                cmd, cmd_child = ctx.Pipe()
                ctl, ctl_child = ctx.Pipe()
                p = ctx.Process(target=rank_loop.main, args=(cmd_child, ctl_child, r, job),
                                name=f"minipar-rank{r}", daemon=True)
                p.start()
                cmd_child.close()
                ctl_child.close()
                self.procs.append(p)
                self.cmd.append(cmd)
                self.ctl.append(ctl)
        _alive.add(self)
        deadline = time.monotonic() + self.start_timeout
        for r, conn in enumerate(self.cmd):
            left = deadline - time.monotonic()
            msg = conn.recv() if wait([conn, self.procs[r].sentinel], max(left, 0)) and conn.poll() else None
            if not msg or msg[0] != "ready":
                why = msg[1] if msg else f"no answer within {self.start_timeout:g} s"
                self.close(kill=True)
                raise RanksError(f"rank {r} of {n} did not start:\n{why}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``kill``: at once, whatever they are doing) and wait for them."""
        stop_workers(self.procs, self.cmd, kill)
        for c in self.cmd + self.ctl:
            c.close()
        self.procs, self.cmd, self.ctl, self.store = [], [], [], None
        _alive.discard(self)

    def restart(self) -> None:
        """Fresh ranks (empty namespaces) of the same size and placement."""
        self.close(kill=True)
        self._start()

    # ------------------------------------------------------------------ cells
    def run(self, source: str, timeout: float = 60.0, grace: float = 2.0, cell: int | None = None) -> Outcome:
        """Run ``source`` on every rank (module docstring): an :class:`Outcome`. ``cell``: the
        number its tracebacks give it (``<rank cell N>``; the notebook's own, say)."""
        note = ""
        if not self.alive():
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs) if not p.is_alive()]
            self.restart()
            note = (f"{', '.join(dead) or 'the ranks'} had ended since the last cell; "
                    f"{self.world_size} fresh ranks run this one (the variables of before are gone)")
        k, n, t0 = next(self.cells) if cell is None else cell, self.world_size, time.monotonic()
        self.sources[k] = source
        request = ("run", k, source, rank_setup.collect(), cell_sources())
        for c in self.cmd:
            c.send(request)
        out = Outcome(k, source, [None] * n, timeout=timeout, note=note)
        pending, deadline = set(range(n)), t0 + timeout
        try:
            while pending:
                handles = {self.cmd[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
                ready = wait(list(handles), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    out.problem = out.problem or "hang"
                    break
                for h in ready:
                    r = handles[h]
                    if r not in pending:
                        continue
                    try:
                        reply = self.cmd[r].recv() if h is self.cmd[r] else None
                    except (EOFError, OSError):
                        reply = None
                    if reply is None:
                        self.procs[r].join(timeout=1)
                        code = self.procs[r].exitcode
                        reply = {"out": "", "value": None, "figure": None, "line": None, "died": True,
                                 "exc": f"(exit code {code}" + (": killed by a signal; -9: out of memory?)"
                                                                if code is not None and code < 0 else ")"),
                                 "error": f"rank {r}'s process ended in the cell (exit code {code})\n"}
                        out.problem = "died"
                    elif reply.get("error") and out.problem is None:
                        out.problem = "error"
                    out.replies[r] = reply
                    pending.discard(r)
                    if out.problem in ("error", "died"):
                        deadline = min(deadline, time.monotonic() + grace)
        except KeyboardInterrupt:
            out.problem = "interrupted"
        if pending or out.problem == "died":
            out.where = self.where()
            self.restart()
            out.restarted = True
        out.seconds = time.monotonic() - t0
        return out

    def where(self, wait_s: float = 3.0) -> list:
        """Every rank's ``rank_loop.where()`` (``None`` for a rank that did not answer)."""
        for c in self.ctl:
            try:
                while c.poll(0):  # a late answer to an earlier question
                    c.recv()
                c.send("where")
            except (EOFError, OSError):
                pass
        out, deadline = [], time.monotonic() + wait_s
        for c in self.ctl:
            try:
                out.append(c.recv() if c.poll(max(0.0, deadline - time.monotonic())) else None)
            except (EOFError, OSError):
                out.append(None)
        return out

    # ------------------------------------------------------------------ values
    def _ask(self, request: tuple) -> list:
        replies = []
        for c in self.cmd:
            c.send(request)
        for c in self.cmd:
            replies.append(c.recv())
        errors = [x[1] for x in replies if x[0] != "ok"]
        if errors:
            raise RanksError(errors[0])
        return [x[1] for x in replies]

    def pull(self, *names: str) -> dict:
        """``{name: [rank 0's value, rank 1's, ...]}`` (tensors on the CPU)."""
        got = [cloudpickle.loads(b) for b in self._ask(("pull", list(names)))]
        return {n: [g[n] for g in got] for n in names}

    def push(self, **values) -> None:
        """Set ``values`` in every rank's namespace (functions travel by value, as with ``launch``)."""
        self._ask(("push", cloudpickle.dumps(values)))

    def trace(self, reset: bool = False) -> _trace.Trace:
        """What the ranks recorded since they started (or since the last ``reset``), times from
        the first event on."""
        ranks = self._ask(("trace", reset))
        t0 = min((e["start"] for evs in ranks for e in evs), default=0.0)
        return _trace.Trace([[{**e, "start": e["start"] - t0, "end": e["end"] - t0} for e in evs]
                             for evs in ranks])

    def source_line(self, at) -> str:
        """The text of ``(file, line)`` of a rank cell, from the driver's copy of its source."""
        if not at:
            return ""
        k = int(at[0].strip("<>").split()[-1])
        lines = self.sources.get(k, "").splitlines()
        return lines[at[1] - 1].strip() if 0 < at[1] <= len(lines) else ""


_alive: set = set()
_current: Ranks | None = None


def current() -> Ranks | None:
    """The ranks the notebook uses now (``None`` before the first ``%%ranks``)."""
    return _current if _current is not None and _current.procs else None


def start(n: int, device: str | None = None, backend: str = "auto") -> tuple[Ranks, str]:
    """The current ranks if they are ``n`` with this placement, else new ones (the old ones
    stopped); with what changed, in words ("" when nothing did)."""
    global _current
    device = device or default_device()
    have = current()
    if have is not None and (have.world_size, have.device, have.backend) == (n, device, backend):
        return have, ""
    note = ""
    if have is not None:
        note = f" (the {have.world_size} ranks before were stopped, and their variables with them)"
        have.close()
    _current = Ranks(n, device, backend)
    return _current, f"started {n} rank{'s' * (n != 1)}: {_current.placement.reason}{note}"


def stop() -> None:
    """Stop every set of ranks this process started (at exit too)."""
    global _current
    for r in list(_alive):
        r.close()
    _current = None


atexit.register(stop)
