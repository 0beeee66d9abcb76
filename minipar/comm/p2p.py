"""Point-to-point communication, recorded.

Thin wrappers over ``torch.distributed.isend/irecv`` that write every transfer to the rank's
trace (:mod:`minipar.trace`) as a ``comm`` event with its bytes, start and end, labelled with
its group's mesh dimension (``dim``, :func:`name_group`). Ranks are *group-local* (rank 0 of a
tensor-parallel group, say); they become global ranks here, once. An event ends when its
transfer completed, stamped by a callback on the work's future where the backend has one
(Gloo's collectives do; its send/recv do not, and end at :meth:`Handle.wait`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import flight, trace
from . import checked, staging


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


_DIMS: dict = {}  # process group -> the mesh dimension it runs along ("dp", "tp", ...)


def name_group(group, dim: str) -> None:
    """Label every communication on ``group`` with ``dim`` (:class:`minipar.mesh.ProcessMesh`
    names its groups); the world (``None``) is ``"world"`` unless named."""
    _DIMS[dist.group.WORLD if group is None else group] = dim


def group_name(group) -> str | None:
    """The dimension ``group`` was named with (:func:`name_group`), else ``"world"`` for the
    world and ``None`` for an unnamed sub-group."""
    g = dist.group.WORLD if group is None else group
    return _DIMS.get(g, "world" if g is dist.group.WORLD else None)


class Handle:
    """Outstanding transfers; :meth:`wait` completes them and records one event, which
    ends when the last transfer completed (not when it was waited for)."""

    def __init__(self, works, name: str, start: float, sent: int, recv: int, labels: dict,
                 op: str | None = None):
        self.works, self.name, self.start = works, name, start
        self.sent, self.recv, self.labels = sent, recv, labels
        op = op or ("send" if not recv else "recv" if not sent else "exchange")
        self._flight = flight.started(op, name, labels.get("dim"))  # what a hang report names
        self.done, self._ends = False, []
        self.after = []  # run once the transfers completed (copies back from host staging)
        for w in works:
            try:
                w.get_future().then(lambda _, ends=self._ends: ends.append(trace.now()))
            except (RuntimeError, AttributeError):  # no future (Gloo send/recv): ends at wait
                self._ends = None
                break

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            if w is not None:
                w.wait()
        self.done = True
        flight.completed(self._flight)
        end = max(self._ends) if self._ends and len(self._ends) == len(self.works) else trace.now()
        trace.record("comm", self.name, self.start, end, self.sent, self.recv, **self.labels)
        for f in self.after:
            f()


def _labels(group, labels: dict) -> dict:
    return {"dim": group_name(group), **labels}


def isend(tensor: torch.Tensor, dst: int, group=None, name: str = "send", tag: int = 0, **labels) -> Handle:
    """Start sending ``tensor`` to group rank ``dst``."""
    labels = _labels(group, labels)
    src = staging.to_host(tensor, "isend", labels) if staging.must_stage(tensor, group, "isend") else tensor
    w = dist.isend(src.contiguous(), global_rank(group, dst), group=group, tag=tag)
    h = Handle([w], name, trace.now(), nbytes(tensor), 0, labels)
    h.staged = src  # kept alive until the send completed
    return h


def irecv(tensor: torch.Tensor, src: int, group=None, name: str = "recv", tag: int = 0, **labels) -> Handle:
    """Start receiving into ``tensor`` (contiguous) from group rank ``src``."""
    labels = _labels(group, labels)
    into = staging.host_like(tensor) if staging.must_stage(tensor, group, "irecv") else tensor
    w = dist.irecv(into, global_rank(group, src), group=group, tag=tag)
    h = Handle([w], name, trace.now(), 0, nbytes(tensor), labels)
    if into is not tensor:
        h.after.append(staging.copy_back(into, tensor, "irecv", labels))
    return h


def send(tensor: torch.Tensor, dst: int, group=None, name: str = "send", **labels) -> None:
    """Blocking send (returns once the transfer has completed)."""
    isend(tensor, dst, group, name, **labels).wait()


def recv(tensor: torch.Tensor, src: int, group=None, name: str = "recv", **labels) -> None:
    """Blocking receive into ``tensor``."""
    irecv(tensor, src, group, name, **labels).wait()


def exchange(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group=None,
             name: str = "exchange", **labels) -> None:
    """Send ``send_buf`` to ``dst`` while receiving ``recv_buf`` from ``src``; one event.
    Posting both before waiting keeps a ring from deadlocking: were every rank to send first,
    blocking, every rank would wait for a receiver that never comes."""
    start, labels = trace.now(), _labels(group, labels)
    if checked.enabled():  # while an exercise runs: a size mismatch said in words, not a Gloo abort
        checked.check_sizes(send_buf, dst, recv_buf, src, group, name, labels)
    out = (staging.to_host(send_buf, "exchange", labels)
           if staging.must_stage(send_buf, group, "exchange") else send_buf)
    into = staging.host_like(recv_buf) if staging.must_stage(recv_buf, group, "exchange") else recv_buf
    ws = [dist.isend(out.contiguous(), global_rank(group, dst), group=group),
          dist.irecv(into, global_rank(group, src), group=group)]
    h = Handle(ws, name, start, nbytes(send_buf), nbytes(recv_buf), labels)
    if into is not recv_buf:
        h.after.append(staging.copy_back(into, recv_buf, "exchange", labels))
    h.wait()
