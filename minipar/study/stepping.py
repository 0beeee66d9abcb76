"""A pipeline step by hand: the real executor, let through one round of its schedule at a time.

``Stepper(pipe, inputs, targets)`` runs ``pipe.step(inputs, targets)``, the executor as it is
(:class:`~minipar.pipeline.Pipeline`), in a thread of this rank, and holds each compute action
(F, B, W) at a gate. :meth:`Stepper.advance` opens the gate for the next round of the
lock-step play of the schedule (:func:`minipar.pipeline.posting.rounds`: in round t a rank computes when every
message it needs was sent in an earlier round), waits for this rank's compute of that round,
if it has one, and says what ran. Sends and receives go on by themselves between the gates.

Called on every rank in one ``%%ranks`` cell, one round per cell, it shows the schedule unfold
on real ranks with real tensors, the bubble included: a rank with nothing to compute in a round
says it is idle. :meth:`Stepper.events` is what ran so far as trace events placed at their
rounds, for :func:`minipar.runtime.viz.timeline`; after the last round, :attr:`Stepper.loss` is
the step's loss, the one ``pipe.step`` returns.
"""
from __future__ import annotations

import threading
import time

from ..pipeline.posting import rounds
from ..pipeline.simulate import NAMES


class Stepper:
    """``pipe.step(inputs, targets)`` on this rank, one round of the schedule per :meth:`advance`."""

    def __init__(self, pipe, inputs, targets):
        self.pipe, self.round, self.ran = pipe, 0, []  # ran: (round, action, seconds)
        when, _ = rounds(pipe.schedule)
        self.mine, self.rounds = when[pipe.rank], 1 + max(t for w in when for t in w)
        self.computes = [a for a in pipe.schedule.actions[pipe.rank] if a.op in NAMES]
        self.loss, self.error = None, None
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        for op in NAMES:  # the instance's F, B, W: the step calls getattr(pipe, a.op)(a)
            setattr(pipe, op, self._gated(getattr(pipe, op)))
        self._thread = threading.Thread(target=self._step, args=(inputs, targets), daemon=True,
                                        name="minipar-pipeline-step")
        self._thread.start()

    def _gated(self, compute):
        def run(a):
            self._go.acquire()
            t = time.perf_counter()
            try:
                compute(a)
            except BaseException as e:
                self.error = e
                raise
            finally:
                self.ran.append((self.round - 1, a, time.perf_counter() - t))
                self._done.release()
        return run

    def _step(self, inputs, targets) -> None:
        try:
            self.loss = self.pipe.step(inputs, targets)
        except BaseException as e:  # noqa: BLE001 - raised again by advance(), on the rank's own thread
            if self.error is None:  # not from a compute (that one released the gate already)
                self.error = e
                self._done.release()

    @property
    def finished(self) -> bool:
        return self.round >= self.rounds

    def advance(self, n: int = 1) -> str:
        """Run the next ``n`` rounds on this rank; one line per round of what it computed."""
        lines = []
        for _ in range(n):
            if self.finished:
                lines.append("the step is over")
                break
            t, k = self.round, len(self.ran)
            self.round += 1
            if k < len(self.mine) and self.mine[k] == t:
                self._go.release()
                self._done.acquire()
                if self.error is not None:
                    raise self.error
                a, seconds = self.ran[-1][1], self.ran[-1][2]
                lines.append(f"round {t}: {a.op}{a.microbatch} ({NAMES[a.op]} of micro-batch "
                             f"{a.microbatch} on stage {a.stage}, {1e3 * seconds:.1f} ms)")
            else:
                nxt = self.computes[k] if k < len(self.computes) else None
                lines.append(f"round {t}: idle" + (f" (its next compute, {nxt.op}{nxt.microbatch}, "
                                                    "waits for a message)" if nxt else ""))
        if self.finished:
            self._thread.join()
            if self.error is not None:
                raise self.error
        return "\n".join(lines)

    def finish(self) -> float | None:
        """Run the rounds left; the step's loss (on the rank holding the last stage)."""
        while not self.finished:
            self.advance()
        return self.loss

    def events(self) -> list[dict]:
        """What ran so far, one trace event per compute, from its round to the next."""
        return [{"rank": self.pipe.rank, "kind": "compute", "name": NAMES[a.op], "start": float(t),
                 "end": t + 1.0, "bytes_sent": 0, "bytes_recv": 0,
                 "labels": {"phase": a.op, "microbatch": a.microbatch, "stage": a.stage,
                            "action": f"{a.op}{a.microbatch}"}}
                for t, a, _ in self.ran]
