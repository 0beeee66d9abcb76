"""The backend's own collectives (Gloo or NCCL), recorded.

The strategies call these for speed: the same operations as :mod:`minipar.comm.ring`, run by
the backend's optimised code. The backend does not report what it sent, so each event records
what this rank's buffers, as handed to the backend, must send and receive in a bandwidth-optimal
schedule (:func:`moved_bytes`): counted from the tensors (their elements, their dtype, this rank's
share), not from the cost formula, which the tests check against these counts
(:func:`minipar.cost.collective_bytes`). Only the forms Gloo accepts are used: flat (1-D) tensors for
all-gather and reduce-scatter, equal sizes on every rank, and SUM (averaging divides afterwards).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..runtime import trace
from ..runtime import staging
from .p2p import Handle, labels_for, device_clock, group_rank, group_size, nbytes

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Averaged(Handle):
    """The handle of one collective: divides ``tensor`` by ``n`` once done (``n = 0``: no
    division) and keeps the ``staged`` host buffers alive until the operation completed."""

    def __init__(self, work, tensor, n, after, staged, **kw):
        super().__init__([work], **kw)
        self.tensor, self.n, self.staged = tensor, n, staged
        self.after += after

    def wait(self) -> None:
        if not self.done:
            super().wait()
            if self.n:
                self.tensor.div_(self.n)


def _via_host(op: str, group, labels: dict, output: torch.Tensor, input: torch.Tensor | None = None):
    """``(output, input, after)``: the buffers the backend gets, which are pinned host copies
    of CUDA tensors where the group has no NCCL (:mod:`minipar.runtime.staging`), and what to run
    once the operation completed (the copy back to the device)."""
    s_out = staging.must_stage(output, group, op)
    s_in = input is not None and staging.must_stage(input, group, op)
    if not (s_out or s_in):
        return output, input, []
    if input is None:  # in place
        host = staging.to_host(output, op, labels)
        return host, None, [staging.copy_back(host, output, op, labels)]
    hin = staging.to_host(input, op, labels) if s_in else input
    hout = staging.host_like(output) if s_out else output
    return hout, hin, [staging.copy_back(hout, output, op, labels)] if s_out else []


def moved_bytes(op: str, out: torch.Tensor, inp: torch.Tensor | None, n: int, rank: int) -> int:
    """Bytes this rank sends, and as many it receives, in ``op`` over ``n`` ranks, counted from the
    buffers the backend moves: an all-gather brings every share but this rank's own ``inp`` into
    ``out``; a reduce-scatter sends every share of ``inp`` but the ``out`` it keeps; an all-reduce
    is both on its tensor, whose share here is slice ``rank`` of ``tensor_split(n)`` (as the
    ring's). Summed over the ranks, or on each rank when n divides the elements, this is the
    ring's count: 2(n-1)/n·N for an all-reduce, (n-1)/n·N otherwise (Patarasuk & Yuan 2009)."""
    if n == 1:
        return 0
    if op == "all_gather":
        return nbytes(out) - nbytes(inp)
    if op == "reduce_scatter":
        return nbytes(inp) - nbytes(out)
    share = out.numel() // n + (rank < out.numel() % n)
    return 2 * (out.numel() - share) * out.element_size()


def _collective(op: str, fn, output, input, avg: bool, group, name, labels, async_op):
    """Run ``fn`` (the backend's ``op``) on the buffers it can move (:func:`_via_host`); the event
    records the bytes those buffers move (:func:`moved_bytes`); ``avg`` divides by n once complete."""
    n = group_size(group)
    if op in ("reduce_scatter", "all_gather"):    # a plain error here, not a backend's abort
        whole, part = ("input", "output") if op == "reduce_scatter" else ("output", "input")
        sizes = {"input": input.numel(), "output": output.numel()}
        if sizes[whole] != n * sizes[part]:
            raise ValueError(f"{op} over a group of {n} ranks needs {whole} = {n} × {part} elements; got "
                             f"{sizes[whole]} and {sizes[part]} (is the group the one the buffers were sized for?)")
    labels = labels_for(group, labels)  # the event's one record, from here passed as it is
    out, inp, after = _via_host(op, group, labels, output, input)
    sent = moved_bytes(op, out, inp, n, group_rank(group))
    meta = {"name": name or op, "op": op, "began": device_clock(out, group), "start": trace.now(),
            "sent": sent, "recv": sent, "labels": labels, "group": group}
    work = fn(*(out,) if inp is None else (out, inp), group=group, async_op=True)
    h = _Averaged(work, output, group_size(group) if avg else 0, after, (out, inp), **meta)
    return h if async_op else h.wait()


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, async_op: bool = False,
               name: str | None = None, **labels):
    """In-place sum (``op="sum"``) or mean (``"avg"``) over ``group``; a Handle if async."""
    return _collective("all_reduce", dist.all_reduce, tensor, None, op == "avg",
                       group, name, labels, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None,
                   async_op: bool = False, name: str | None = None, **labels):
    """``output`` (k elements) = this rank's chunk of the sum of flat ``input`` (n·k)."""
    return _collective("reduce_scatter", _reduce_scatter, output, input, op == "avg",
                       group, name, labels, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               name: str | None = None, **labels):
    """Flat ``output`` (n·k elements) = every rank's flat ``input`` (k) in rank order."""
    return _collective("all_gather", _all_gather, output, input, False,
                       group, name, labels, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False,
                      name: str | None = None, **labels):
    """Chunk j of ``input`` (``input_split_sizes[j]`` rows along dim 0; equal chunks if
    ``None``) goes to group rank j, and ``output`` receives chunk i from rank i in rank
    order (``output_split_sizes[i]`` rows). Gloo's only all-to-all form. The event records
    the bytes that actually leave and arrive (a rank's own chunk stays put)."""
    n, me = group_size(group), dist.get_rank(group)
    row = math.prod(input.shape[1:]) * input.element_size()  # bytes per row
    in_s = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
    out_s = list(output_split_sizes) if output_split_sizes is not None else [output.shape[0] // n] * n
    labels = labels_for(group, labels)
    out, inp, after = _via_host("all_to_all_single", group, labels, output, input.contiguous())
    meta = {"name": name or "all_to_all", "began": device_clock(out, group), "start": trace.now(),
            "sent": (sum(in_s) - in_s[me]) * row, "recv": (sum(out_s) - out_s[me]) * row,
            "labels": labels, "op": "all_to_all", "group": group}
    work = dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes,
                                  group=group, async_op=True)
    h = _Averaged(work, output, 0, after, (out, inp), **meta)
    return h if async_op else h.wait()
