"""GPU tensors over Gloo: staged through pinned host memory, and recorded as such.

When ranks share one GPU (:func:`minipar.runtime.backend.place`) they compute on CUDA tensors but talk
over Gloo, which moves CPU memory: every :mod:`minipar.comm` call copies its CUDA input into a
page-locked (pinned) host buffer, runs on it and copies the result back::

    cuda tensor --(stage to host)--> pinned buffer --Gloo--> pinned buffer --(stage to device)--> cuda tensor

Each copy is a ``comm`` event, ``"stage to host"`` / ``"stage to device"``, with the operation's
labels plus the reserved ``staged=<operation>`` (:data:`minipar.runtime.trace.RESERVED`: the
operation's labels may hold ``stage``, a pipeline's), with no bytes (the operation's own event records them as on the CPU), so
the timeline shows what staging costs. Under ``"cpu:gloo,cuda:nccl"`` CUDA tensors go to NCCL
and CPU tensors to Gloo. A tensor the group cannot move is an error naming both: a CUDA tensor
on ranks placed on the CPU, a CPU tensor on an NCCL-only group, a ``meta`` tensor anywhere.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import trace

_BACKENDS: dict = {}


def group_backend(group) -> str:
    """``dist.get_backend(group)`` as a string ("gloo", "nccl", "cpu:gloo,cuda:nccl"), cached."""
    g = dist.group.WORLD if group is None else group
    if g not in _BACKENDS:
        _BACKENDS[g] = str(dist.get_backend(group))
    return _BACKENDS[g]


def must_stage(tensor: torch.Tensor, group, op: str) -> bool:
    """Whether ``tensor`` goes through host memory for ``op`` on ``group`` (a CUDA tensor on
    a group without NCCL); raises ``ValueError`` for a tensor this group cannot move."""
    backend, kind = group_backend(group), tensor.device.type
    if kind == "cuda":
        if "nccl" in backend:
            return False
        if os.environ.get("MINIPAR_DEVICE", "").startswith("cpu"):
            raise ValueError(
                f"comm.{op}: the tensor is on {tensor.device} but this group's backend is {backend} "
                f"and the ranks were placed on the CPU (launch(device='cpu'), or no GPU was used). "
                f"Keep the tensors on minipar.device(), or launch with device='auto' or 'cuda'.")
        return True
    if kind == "cpu":
        if "gloo" not in backend and "nccl" in backend:
            raise ValueError(
                f"comm.{op}: the tensor is on cpu but this group's backend is {backend}, which moves "
                f"CUDA tensors only. Move it with .to(minipar.device()) first.")
        return False
    raise ValueError(f"comm.{op}: the tensor is on {tensor.device}, which no backend can move "
                     f"(this group's backend is {backend}). Every tensor must live on "
                     f"minipar.device(): a tensor created without device= may have landed here.")


def to_host(tensor: torch.Tensor, op: str, labels: dict) -> torch.Tensor:
    """A pinned host copy of ``tensor`` (an event ``"stage to host"``). The copy waits for the
    kernels queued before it (the backward that made a gradient, say): when recording, those
    are waited for *before* the event starts, so it spans the copy alone."""
    if trace.recording_on() and tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()
    t = trace.now()
    host = host_like(tensor).copy_(tensor)
    trace.record("comm", "stage to host", t, trace.now(), labels={**labels, "staged": op})
    return host


def host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty pinned host buffer shaped like ``tensor`` (for a result to copy back); pinned
    memory comes from PyTorch's caching host allocator, so a step's buffers are reused."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)


def copy_back(host: torch.Tensor, tensor: torch.Tensor, op: str, labels: dict):
    """A callable that copies ``host`` into the device ``tensor`` (an event ``"stage to device"``)."""
    def run() -> None:
        t = trace.now()
        tensor.copy_(host)
        trace.record("comm", "stage to device", t, trace.now(), labels={**labels, "staged": op})
    return run
