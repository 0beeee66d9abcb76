"""Point-to-point communication, recorded.

Thin wrappers over ``torch.distributed.isend/irecv`` that add one thing: every transfer
is written to the rank's trace (:mod:`minipar.trace`) as a ``comm`` event with its bytes,
start and end. Ranks are *group-local* (rank 0 of a tensor-parallel group, say); the
translation to global ranks happens here, once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import trace


def group_rank(group=None) -> int:
    """This rank's index inside ``group`` (the world when ``None``)."""
    return dist.get_rank(group)


def group_size(group=None) -> int:
    """Number of ranks in ``group`` (the world when ``None``)."""
    return dist.get_world_size(group)


def global_rank(group, r: int) -> int:
    """Global rank of the ``r``-th member of ``group``."""
    return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Handle:
    """Outstanding transfers; :meth:`wait` completes them and records one event."""

    def __init__(self, works, name: str, start: float, sent: int, recv: int, labels: dict):
        self.works, self.name, self.start = works, name, start
        self.sent, self.recv, self.labels = sent, recv, labels
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            if w is not None:
                w.wait()
        self.done = True
        trace.record("comm", self.name, self.start, trace.now(), self.sent, self.recv, **self.labels)


def isend(tensor: torch.Tensor, dst: int, group=None, name: str = "send", tag: int = 0, **labels) -> Handle:
    """Start sending ``tensor`` to group rank ``dst``."""
    w = dist.isend(tensor.contiguous(), global_rank(group, dst), group=group, tag=tag)
    return Handle([w], name, trace.now(), nbytes(tensor), 0, labels)


def irecv(tensor: torch.Tensor, src: int, group=None, name: str = "recv", tag: int = 0, **labels) -> Handle:
    """Start receiving into ``tensor`` (contiguous) from group rank ``src``."""
    w = dist.irecv(tensor, global_rank(group, src), group=group, tag=tag)
    return Handle([w], name, trace.now(), 0, nbytes(tensor), labels)


def send(tensor: torch.Tensor, dst: int, group=None, name: str = "send", **labels) -> None:
    """Blocking send (returns once the transfer has completed)."""
    isend(tensor, dst, group, name, **labels).wait()


def recv(tensor: torch.Tensor, src: int, group=None, name: str = "recv", **labels) -> None:
    """Blocking receive into ``tensor``."""
    irecv(tensor, src, group, name, **labels).wait()


def exchange(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group=None,
             name: str = "exchange", **labels) -> None:
    """Send ``send_buf`` to ``dst`` while receiving ``recv_buf`` from ``src``; one event.

    Posting both before waiting is what keeps a ring from deadlocking: if every rank
    first did a blocking send, every rank would wait for a receiver that never comes.
    """
    start = trace.now()
    ws = [dist.isend(send_buf.contiguous(), global_rank(group, dst), group=group),
          dist.irecv(recv_buf, global_rank(group, src), group=group)]
    Handle(ws, name, start, nbytes(send_buf), nbytes(recv_buf), labels).wait()
