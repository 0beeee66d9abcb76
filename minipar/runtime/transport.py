"""How one message travels, read from the placement ``launch`` decided: the only place that asks.

:mod:`minipar.comm` hands every tensor it moves to :func:`route`, which answers from
:func:`minipar.runtime.backend.current` (the rank's :class:`~minipar.runtime.backend.Placement`)
and the tensor's device:

==================  =======================================================================
``transport``       a tensor on the ranks' compute device goes
==================  =======================================================================
``"nccl"``          ``"nccl"`` (a CPU tensor: Gloo, the ``cpu:gloo,cuda:nccl`` group's other half)
``"gloo-staged"``   ``"staged"``: copied into a host buffer, moved by Gloo, copied back
                    (:mod:`minipar.runtime.staging`); on the CPU the same copies, plain buffers
``"gloo"``          ``"gloo"``, as it is
==================  =======================================================================

So a shared GPU's path is the CPU's with another field (``launch(..., transport="gloo-staged")``).
The placement's ``clock`` says how a transfer is timed: NCCL's work is only queued by the host,
so it is timed by CUDA events (:func:`device_event`). A tensor the placement cannot move is an
error naming both: a CUDA tensor on ranks placed on the CPU, a CPU tensor on an NCCL-only group,
a ``meta`` tensor anywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import current

_BACKENDS: dict = {}


def group_backend(group) -> str:
    """``dist.get_backend(group)`` as a string ("gloo", "nccl", "cpu:gloo,cuda:nccl"), cached."""
    g = dist.group.WORLD if group is None else group
    if g not in _BACKENDS:
        _BACKENDS[g] = str(dist.get_backend(group))
    return _BACKENDS[g]


def route(tensor: torch.Tensor, group, op: str) -> str:
    """``"nccl"``, ``"gloo"`` or ``"staged"``: how ``tensor`` travels for ``op`` on ``group``
    under the current placement; raises ``ValueError`` for a tensor it cannot move."""
    p, kind = current(), tensor.device.type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"comm.{op}: the tensor is on {tensor.device}, which no backend can move "
                         f"(the ranks' transport is {p.transport}). Every tensor must live on "
                         f"minipar.device(): a tensor created without device= may have landed here.")
    if p.transport == "nccl":
        if kind == "cuda":
            return "nccl"
        backend = group_backend(group)
        if "gloo" not in backend:
            raise ValueError(f"comm.{op}: the tensor is on cpu but this group's backend is {backend}, "
                             f"which moves CUDA tensors only. Move it with .to(minipar.device()) first.")
        return "gloo"
    if kind == "cuda" and p.device == "cpu":
        raise ValueError(
            f"comm.{op}: the tensor is on {tensor.device} but the ranks were placed on the CPU "
            f"(transport {p.transport}: launch(device='cpu'), or no GPU was used). Keep the tensors "
            f"on minipar.device(), or launch with device='auto' or 'cuda'.")
    return "staged" if p.transport == "gloo-staged" and kind == p.device else "gloo"


def gloo_receives_any(tensor: torch.Tensor, group) -> bool:
    """Whether Gloo itself receives into ``tensor`` from any source on ``group`` (``irecv(src=None)``,
    which NCCL has not): a CPU tensor on a group with Gloo, whatever the transport."""
    return tensor.device.type == "cpu" and "gloo" in group_backend(group)


def carried_by_nccl(tensor: torch.Tensor, group) -> bool:
    """Whether NCCL moves ``tensor`` on ``group`` (its sends and receives can be batched)."""
    return route(tensor, group, "send") == "nccl"


def device_clock(tensor: torch.Tensor, group):
    """A CUDA event recorded now on the current stream when NCCL moves ``tensor`` (the
    placement's clock is the device's), else ``None`` (the host's clock times it)."""
    return device_event() if current().clock == "device" and carried_by_nccl(tensor, group) else None


def device_event():
    """A timing CUDA event recorded now on the current stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
