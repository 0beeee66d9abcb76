"""What a training loop needs to survive faults: exit codes, preemption signals, one agreed
verdict per step, and a snapshot to undo a step whose loss is not finite.

* **Preemption.** A scheduler signals a job before it kills it (Slurm: ``SIGTERM`` at
  preemption, ``--signal=USR1@120`` before the time limit). :class:`StopSignals` turns
  ``SIGTERM``/``SIGUSR1`` into a flag; the loop finishes the step in flight, checkpoints and
  exits with :data:`EXIT_PREEMPTED`.
* **Agreement.** A signal reaches the ranks at different moments and a NaN may appear on one
  rank only, yet every rank must stop (or skip) at the same step, or the next collective hangs:
  :func:`agree` all-gathers each rank's ``(loss, stop requested)``, one tiny collective a step.
* **Non-finite loss.** :class:`Snapshot` copies this rank's parameters and optimizer state, so
  a step whose loss is NaN or Inf can be undone instead of poisoning AdamW's moments for good.

Exit codes of ``python -m minipar.train`` (each rank's under ``torchrun``): 0 done; 1 an
error; 2 bad configuration or checkpoint, before training; :data:`EXIT_NONFINITE` (3) a
NaN/Inf loss; :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: try again) stopped by a signal
after checkpointing; ``124`` no progress for the hang timeout (:mod:`minipar.runtime.flight`).
"""
from __future__ import annotations

import os
import signal

import torch

from .. import comm
from ..runtime import pool
from ..runtime.backend import device
from ..runtime.flight import EXIT_HUNG
from .checkpoint import local_pieces

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "temporary failure; the user is invited to retry"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

__all__ = ["EXIT_CONFIG", "EXIT_NONFINITE", "EXIT_PREEMPTED", "EXIT_HUNG", "StopSignals",
           "forward_to_ranks", "agree", "Snapshot", "rss_bytes"]


class StopSignals:
    """``with StopSignals() as stop: ... stop.requested``: ``SIGTERM``/``SIGUSR1`` set a flag
    instead of ending the process (the previous handlers come back on exit)."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals, self.requested, self.received, self._before = signals, False, None, {}

    def _handle(self, signum, frame) -> None:
        self.requested, self.received = True, signal.Signals(signum).name

    def __enter__(self):
        self._before.update({s: signal.signal(s, self._handle) for s in self.signals})
        return self

    def __exit__(self, *exc):
        for s, h in self._before.items():
            signal.signal(s, h)
        return False


def forward_to_ranks(world: int) -> dict:
    """In the driver of :func:`minipar.runtime.launch`: pass ``SIGTERM``/``SIGUSR1`` sent to it on to
    the ranks (the first ``world`` processes of the pool). Returns the previous handlers."""
    def forward(signum, frame):
        for pid in pool.rank_pids(world):
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, TypeError):
                pass
    return {s: signal.signal(s, forward) for s in STOP_SIGNALS}


def agree(loss: float, stop: bool, group=None) -> tuple[list[float], bool]:
    """Every rank's ``loss`` (rank order) and whether any rank asked to stop."""
    here = device()
    mine = torch.tensor([loss, float(stop)], dtype=torch.float64, device=here)
    world = comm.group_size(group)
    if world == 1:
        return [loss], stop
    out = torch.empty(2 * world, dtype=torch.float64, device=here)
    comm.all_gather(out, mine, group=group, name="step verdict")
    return out[0::2].tolist(), bool(out[1::2].any())


class Snapshot:
    """This rank's parameters and optimizer state (with ZeRO's master shards), to put back
    after a skipped step: :meth:`take` before the step, :meth:`restore` to undo it."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.inner = model, optimizer, getattr(optimizer, "optim", optimizer)
        self.inners = [getattr(o, "optim", o) for o in getattr(optimizer, "parts", [optimizer])]  # several as one

    def _pieces(self):
        return local_pieces(self.model, self.optimizer)

    def take(self) -> None:
        self._had = {id(p) for inner in self.inners for p, st in inner.state.items() if st}
        self._saved = {p.descriptor(): p.data.clone() for p in self._pieces()}
        self._shards = [s.detach().clone() for s in getattr(self.optimizer, "shards", [])]

    def restore(self) -> None:
        for inner in self.inners:
            for p in [p for p, st in inner.state.items() if st and id(p) not in self._had]:
                del inner.state[p]  # state the undone step created
        with torch.no_grad():
            for piece in self._pieces():
                piece.data.copy_(self._saved[piece.descriptor()])
            for s, saved in zip(getattr(self.optimizer, "shards", []), self._shards):
                s.copy_(saved)


def rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; else the peak, from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource   # deferred: a Unix-only module, needed only where /proc is not
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024
