"""Point-to-point communication, recorded.

Thin wrappers over ``torch.distributed.isend/irecv`` that write every transfer to the rank's
trace (:mod:`minipar.runtime.trace`) as a ``comm`` event with its bytes, start and end, labelled with
its group's mesh dimension (``dim``, :func:`name_group`). Ranks are *group-local* (rank 0 of a
tensor-parallel group, say); they become global ranks here, once. An event ends when its
transfer completed, stamped by a callback on the work's future where the backend has one
(Gloo's collectives do; its send/recv do not, and end at :meth:`Handle.wait`); NCCL work is
timed with CUDA events on the device.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..runtime import flight
from ..runtime import trace
from ..runtime import checked, staging
from ..runtime.transport import carried_by_nccl as moved_by_nccl, device_clock, device_event


def group_rank(group=None) -> int:
    """This rank's index inside ``group`` (the world when ``None``)."""
    return dist.get_rank(group)


def group_size(group=None) -> int:
    """Number of ranks in ``group`` (the world when ``None``)."""
    return dist.get_world_size(group)


def global_rank(group, r: int) -> int:
    """Global rank of the ``r``-th member of ``group``."""
    return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)


def group_ranks(group=None) -> tuple[int, ...] | None:
    """The global ranks of ``group``'s members in group-rank order (the world when ``None``):
    what a ``comm`` event records as its ``group``; ``None`` outside a process group."""
    if not dist.is_initialized():
        return None
    g = dist.group.WORLD if group is None else group
    return (tuple(range(dist.get_world_size())) if g is dist.group.WORLD
            else tuple(dist.get_process_group_ranks(g)))


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
    ends when the last transfer completed (not when it was waited for).

    Under NCCL the work's future completes once the kernels are *queued*, so there the
    duration comes from CUDA events instead: ``began`` (:func:`device_clock`) was recorded on
    the rank's stream before the work was posted, :meth:`wait` records one after it (the
    stream then waits for NCCL's), and the event lasts ``began.elapsed_time(end)``. The flight
    recorder keeps such work "waiting" until that end event has passed."""

    def __init__(self, works, name: str, start: float, sent: int, recv: int, labels: dict,
                 op: str | None = None, began=None, group=None):
        self.works, self.name, self.start = works, name, start
        self.sent, self.recv, self.labels = sent, recv, labels
        op = op or ("send" if not recv else "recv" if not sent else "exchange")
        self.op, self.group = op, group   # the event's kind and the group it ran on
        self._flight = flight.started(op, name, labels.get("dim"))  # what a hang report names
        self.done, self._ends, self.began = False, [], began
        self.after = []  # run once the transfers completed (copies back from host staging)
        self.deferred = False  # collected by :func:`batched`, not posted yet
        for w in works if began is None else ():
            try:
                w.get_future().then(lambda _, ends=self._ends: ends.append(trace.now()))
            except (RuntimeError, AttributeError):  # no future (Gloo send/recv): ends at wait
                self._ends = None
                break

    def wait(self) -> None:
        if self.done or self.deferred:
            return  # done, or inside :func:`batched`: waited when its batch is posted
        for w in self.works:
            if w is not None:
                w.wait()
        self.done = True
        if self.began is not None:
            end = self._device_end()
        else:
            flight.completed(self._flight)
            end = max(self._ends) if self._ends and len(self._ends) == len(self.works) else trace.now()
        trace.record("comm", self.name, self.start, end, self.sent, self.recv, self.labels,
                     op=self.op, group=group_ranks(self.group) if trace.recording_on() else None)
        for f in self.after:
            f()

    def _device_end(self) -> float:
        """The end of NCCL work from CUDA events: when recording, wait for it and return
        ``start + elapsed``; otherwise hand the flight recorder the event to ask later."""
        end_ev = device_event()  # on the current stream, which w.wait() made wait for NCCL's
        if not trace.recording_on():
            flight.completed(self._flight, pending=end_ev.query)
            return self.start
        end_ev.synchronize()
        flight.completed(self._flight)
        return self.start + self.began.elapsed_time(end_ev) / 1e3


def labels_for(group, labels: dict) -> dict:
    """An event's one record of labels, made once where a call enters :mod:`minipar.comm`:
    the caller's ``labels`` with the group's mesh dimension as ``dim`` (unless the caller named
    one). From here the record is passed down as one object (to staging and the trace), never
    spread into keywords again; a key the library writes itself (``staged``) is refused."""
    if "staged" in labels:
        raise ValueError(f"the label 'staged' is reserved ({trace.RESERVED['staged']}); "
                         f"name this label otherwise")
    return {"dim": group_name(group), **labels}


def isend(tensor: torch.Tensor, dst: int, group=None, name: str = "send", tag: int = 0, **labels) -> Handle:
    """Start sending ``tensor`` to group rank ``dst`` (inside :func:`batched`, under NCCL:
    collected, posted with the batch)."""
    labels = labels_for(group, labels)
    if checked.enabled():
        checked.check_peer(dst, group, "sends to", name, labels)
    if _BATCH is not None and moved_by_nccl(tensor, group):
        return _collect(dist.isend, tensor.contiguous(), dst, group, tag, name, nbytes(tensor), 0, labels)
    src = staging.to_host(tensor, "isend", labels) if staging.must_stage(tensor, group, "isend") else tensor
    began, t = device_clock(tensor, group), trace.now()
    w = dist.isend(src.contiguous(), global_rank(group, dst), group=group, tag=tag)
    h = Handle([w], name, t, nbytes(tensor), 0, labels, began=began, group=group)
    h.staged = src  # kept alive until the send completed
    return h


def irecv(tensor: torch.Tensor, src: int, group=None, name: str = "recv", tag: int = 0, **labels) -> Handle:
    """Start receiving into ``tensor`` (contiguous) from group rank ``src`` (inside
    :func:`batched`, under NCCL: collected, filled when the batch ends)."""
    labels = labels_for(group, labels)
    if checked.enabled():
        checked.check_peer(src, group, "receives from", name, labels)
    if _BATCH is not None and moved_by_nccl(tensor, group):
        return _collect(dist.irecv, tensor, src, group, tag, name, 0, nbytes(tensor), labels)
    into = staging.host_like(tensor) if staging.must_stage(tensor, group, "irecv") else tensor
    began, t = device_clock(tensor, group), trace.now()
    w = dist.irecv(into, global_rank(group, src), group=group, tag=tag)
    h = Handle([w], name, t, 0, nbytes(tensor), labels, began=began, group=group)
    if into is not tensor:
        h.after.append(staging.copy_back(into, tensor, "irecv", labels))
    return h


_BATCH = None  # inside batched(): the (P2POp, Handle) pairs collected, in posting order


def _collect(op, tensor, peer, group, tag, name, sent, recv, labels) -> Handle:
    began, t = device_clock(tensor, group), trace.now()
    h = Handle([], name, t, sent, recv, labels, began=began, group=group)
    h.deferred, h.staged = True, tensor
    _BATCH.append((dist.P2POp(op, tensor, global_rank(group, peer), group, tag), h))
    return h


@contextmanager
def batched():
    """Inside, the sends and receives NCCL moves are collected, and posted at the end as one
    ``batch_isend_irecv`` whose work is then waited (Gloo's go out at once, as outside).

    Why: NCCL runs a rank's point-to-point operations in posting order on one stream, and a
    send larger than its buffers completes only once the peer's matching receive runs. When
    neighbouring pipeline ranks each post a send to the other before the receive from it
    (1F1B's steady state: ``SEND_F`` then ``RECV_B`` on rank s, ``SEND_B`` then ``RECV_F`` on
    s+1), both sends wait for receives queued behind them: a cycle. Grouped operations
    progress together, so a batch of one send and one receive per rank completes (which
    receives go with which sends, for every schedule: :mod:`minipar.pipeline.posting`). A
    receive collected here must not be read before the block ends."""
    global _BATCH
    outer, _BATCH = _BATCH, []
    try:
        yield
        ops, collected = [op for op, _ in _BATCH], _BATCH
    finally:
        _BATCH = outer
    if not ops:
        return
    works = dist.batch_isend_irecv(ops)
    for (_, h), w in zip(collected, works):
        h.works, h.deferred = [w], False
    for _, h in collected:
        h.wait()


def send(tensor: torch.Tensor, dst: int, group=None, name: str = "send", **labels) -> None:
    """Blocking send (returns once the transfer has completed)."""
    isend(tensor, dst, group, name, **labels).wait()


def recv(tensor: torch.Tensor, src: int, group=None, name: str = "recv", **labels) -> None:
    """Blocking receive into ``tensor``."""
    irecv(tensor, src, group, name, **labels).wait()


def start_exchange(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group=None,
                   name: str = "exchange", tag: int = 0, **labels) -> Handle:
    """Start sending ``send_buf`` to ``dst`` while receiving ``recv_buf`` from ``src``; the
    :class:`Handle` records one event at ``wait()``. Under NCCL both go in one
    ``batch_isend_irecv``: NCCL builds a pair's communicator when the pair's first operation
    is posted and blocks until both peers join, so were every rank of a ring to post its send
    to the right alone first, each would wait for a neighbour waiting on its own right
    neighbour: a cycle, from 3 ranks on. A batch joins every peer it names at once."""
    labels = labels_for(group, labels)
    if checked.enabled():  # a peer outside the group or the rank itself, said in words
        checked.check_peer(dst, group, "sends to", name, labels)
        checked.check_peer(src, group, "receives from", name, labels)
    to, frm = global_rank(group, dst), global_rank(group, src)
    if checked.enabled():  # while an exercise runs: a size mismatch said in words, not a Gloo abort
        checked.check_sizes(send_buf, to, recv_buf, frm, group, name, labels)
    out = (staging.to_host(send_buf, "exchange", labels)
           if staging.must_stage(send_buf, group, "exchange") else send_buf)
    into = staging.host_like(recv_buf) if staging.must_stage(recv_buf, group, "exchange") else recv_buf
    began, start = device_clock(send_buf, group), trace.now()
    if moved_by_nccl(out, group) and moved_by_nccl(into, group):
        ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, out.contiguous(), to, group, tag),
                                     dist.P2POp(dist.irecv, into, frm, group, tag)])
    else:  # Gloo: two posts, both before any wait (no rank then waits on its receiver)
        ws = [dist.isend(out.contiguous(), to, group=group, tag=tag),
              dist.irecv(into, frm, group=group, tag=tag)]
    h = Handle(ws, name, start, nbytes(send_buf), nbytes(recv_buf), labels, began=began, group=group)
    h.staged = out  # kept alive until the send completed
    if into is not recv_buf:
        h.after.append(staging.copy_back(into, recv_buf, "exchange", labels))
    return h


def exchange(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group=None,
             name: str = "exchange", **labels) -> None:
    """Send ``send_buf`` to ``dst`` while receiving ``recv_buf`` from ``src``; one event.
    Posting both before waiting keeps a ring from deadlocking: were every rank to send first,
    blocking, every rank would wait for a receiver that never comes (and under NCCL they go
    in one batch, :func:`start_exchange`)."""
    start_exchange(send_buf, dst, recv_buf, src, group, name, **labels).wait()
