"""Messages staged through host memory, and recorded as such (the ``"gloo-staged"`` transport).

When ranks share one GPU (:func:`minipar.runtime.backend.place`) they compute on CUDA tensors but talk
over Gloo, which moves CPU memory: every :mod:`minipar.comm` call copies its CUDA input into a
page-locked (pinned) host buffer, runs on it and copies the result back::

    cuda tensor --(stage to host)--> pinned buffer --Gloo--> pinned buffer --(stage to device)--> cuda tensor

The same transport chosen on the CPU (``launch(..., transport="gloo-staged")``) makes the same
copies out and back through plain host buffers, with the same events and labels: the shared
GPU's path, run without a GPU. Which tensors are staged is :func:`minipar.runtime.transport.route`'s
answer. Each copy is a ``staging`` event (not a ``comm`` one: a copy is not a collective, and
counts of operations and bytes stay those of the unstaged run), ``"stage to host"`` /
``"stage to device"``, with the operation's labels plus the reserved ``staged=<operation>``
(:data:`minipar.runtime.trace.RESERVED`: the operation's labels may hold ``stage``, a
pipeline's) and no bytes, so the timeline shows what staging costs.
"""
from __future__ import annotations

import torch

from . import trace
from .transport import route

KIND = "staging"  # the trace kind of a host copy


def must_stage(tensor: torch.Tensor, group, op: str) -> bool:
    """Whether ``tensor`` goes through host memory for ``op`` on ``group`` (the placement's
    transport is ``"gloo-staged"`` and the tensor is on the ranks' device); raises
    ``ValueError`` for a tensor the placement cannot move (:func:`~minipar.runtime.transport.route`)."""
    return route(tensor, group, op) == "staged"


def to_host(tensor: torch.Tensor, op: str, labels: dict) -> torch.Tensor:
    """A host copy of ``tensor`` (an event ``"stage to host"``). The copy waits for the
    kernels queued before it (the backward that made a gradient, say): when recording, those
    are waited for *before* the event starts, so it spans the copy alone."""
    if trace.recording_on() and tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()
    t = trace.now()
    host = host_like(tensor).copy_(tensor)
    trace.record(KIND, "stage to host", t, trace.now(), labels={**labels, "staged": op})
    return host


def host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host buffer shaped like ``tensor`` (for a result to copy back): pinned for a
    CUDA tensor (PyTorch's caching host allocator reuses a step's buffers), plain on the CPU."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)


def copy_back(host: torch.Tensor, tensor: torch.Tensor, op: str, labels: dict):
    """A callable that copies ``host`` into ``tensor`` (an event ``"stage to device"``)."""
    def run() -> None:
        t = trace.now()
        tensor.copy_(host)
        trace.record(KIND, "stage to device", t, trace.now(), labels={**labels, "staged": op})
    return run
