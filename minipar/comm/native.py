"""The backend's own collectives (Gloo or NCCL), recorded.

The strategies in minipar call these for speed; they are the same operations as the ring
versions in :mod:`minipar.comm.ring`, done by the backend's optimised code. Since the
backend does not report what it sent, each event records the bytes the **ring algorithm**
would send (:func:`minipar.cost.collective_bytes`), the figure the literature's formulas use.

Only the forms Gloo accepts are used: flat (1-D) tensors for all-gather and
reduce-scatter, equal sizes on every rank, and SUM (averaging divides afterwards).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import trace
from ..cost import collective_bytes
from .p2p import Handle, group_size, nbytes

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Averaged(Handle):
    def __init__(self, work, tensor, n, **kw):
        super().__init__([work], **kw)
        self.tensor, self.n = tensor, n

    def wait(self) -> None:
        if not self.done:
            super().wait()
            if self.n:
                self.tensor.div_(self.n)


def _start(op: str, full_bytes: int, group, name: str | None, labels: dict):
    sent = collective_bytes(op, full_bytes, group_size(group))
    return {"name": name or op, "start": trace.now(), "sent": round(sent), "recv": round(sent),
            "labels": labels}


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, async_op: bool = False,
               name: str | None = None, **labels):
    """In-place sum (``op="sum"``) or mean (``"avg"``) over ``group``; a Handle if async."""
    meta = _start("all_reduce", nbytes(tensor), group, name, labels)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    h = _Averaged(work, tensor, group_size(group) if op == "avg" else 0, **meta)
    return h if async_op else h.wait()


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None,
                   async_op: bool = False, name: str | None = None, **labels):
    """``output`` (k elements) = this rank's chunk of the sum of flat ``input`` (n·k)."""
    meta = _start("reduce_scatter", nbytes(input), group, name, labels)
    work = _reduce_scatter(output, input, group=group, async_op=True)
    h = _Averaged(work, output, group_size(group) if op == "avg" else 0, **meta)
    return h if async_op else h.wait()


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               name: str | None = None, **labels):
    """Flat ``output`` (n·k elements) = every rank's flat ``input`` (k) in rank order."""
    meta = _start("all_gather", nbytes(output), group, name, labels)
    work = _all_gather(output, input, group=group, async_op=True)
    h = _Averaged(work, output, 0, **meta)
    return h if async_op else h.wait()
