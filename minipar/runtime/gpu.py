"""What a GPU run measures, in one place: the allocator's peak memory and true elapsed time.

* **Memory.** ``with gpu.peak_memory() as m: step()`` resets the CUDA caching allocator's peak counter
  (``torch.cuda.reset_peak_memory_stats``) and reads ``torch.cuda.max_memory_allocated`` after the
  block (the peak before the reset is kept: :func:`max_allocated` is the running maximum): ``m.bytes`` is the most memory the block's tensors held at once on this rank's GPU (``None``
  on the CPU, where minipar counts tensors itself, e.g. :func:`minipar.zero.held_state_bytes`). It
  exceeds a tensor count by the allocator's rounding (blocks of 512 B, segments of 2 MiB), the
  workspaces of cuBLAS/cuDNN and the activations autograd saves; ``m.reserved`` adds what the
  allocator keeps cached. The CUDA context itself (a few hundred MiB) is in neither.
* **Time.** CUDA kernels run asynchronously and NCCL returns before its transfer is done, so a
  host clock read right after a call measures the queueing. :func:`synchronize` waits for the
  device first; :func:`elapsed` times a block with CUDA events on GPUs (host clock on CPUs).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .backend import device as _device


def _cuda(device=None) -> torch.device | None:
    d = torch.device(device) if device is not None else _device()
    return d if d.type == "cuda" else None


def synchronize(device=None) -> None:
    """Wait until ``device`` (default: :func:`minipar.device`) finished its work; nothing on the CPU."""
    if (d := _cuda(device)) is not None:
        torch.cuda.synchronize(d)


@dataclass
class Peak:
    """Peak allocated and reserved bytes of a block (``None`` off the GPU)."""

    bytes: int | None = None
    reserved: int | None = None
    device: str = "cpu"


_running: dict[str, int] = {}  # device -> the allocator's peaks that resets have cleared


def max_allocated(device=None) -> int | None:
    """The most memory tensors held at once on ``device`` since :func:`reset_max_allocated`
    (a rank: since its job began), across the resets :func:`peak_memory` makes; ``None`` on
    the CPU. What ``course.py test --gpu`` reports per rank."""
    if (d := _cuda(device)) is None:
        return None
    return max(_running.get(str(d), 0), torch.cuda.max_memory_allocated(d))


def reset_max_allocated(device=None) -> None:
    """Start :func:`max_allocated` again (and the allocator's own peak counter)."""
    if (d := _cuda(device)) is not None:
        _running.pop(str(d), None)
        torch.cuda.reset_peak_memory_stats(d)


@contextmanager
def peak_memory(device=None):
    """``with peak_memory() as m: ...`` then ``m.bytes``: the allocator's peak during the block."""
    d = _cuda(device)
    out = Peak(device=str(d or "cpu"))
    if d is not None:
        torch.cuda.synchronize(d)
        _running[str(d)] = max_allocated(d)  # the reset below must not lose the peak so far
        torch.cuda.reset_peak_memory_stats(d)
    try:
        yield out
    finally:
        if d is not None:
            torch.cuda.synchronize(d)
            out.bytes, out.reserved = torch.cuda.max_memory_allocated(d), torch.cuda.max_memory_reserved(d)


@dataclass
class Elapsed:
    seconds: float = 0.0


@contextmanager
def elapsed(device=None):
    """``with elapsed() as t: ...`` then ``t.seconds``: CUDA-event time on a GPU (the device's
    own clock, from the first kernel queued to the last finished), host time on the CPU."""
    d, out = _cuda(device), Elapsed()
    if d is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(d))
    t = time.perf_counter()
    try:
        yield out
    finally:
        if d is None:
            out.seconds = time.perf_counter() - t
        else:
            end.record(torch.cuda.current_stream(d))
            end.synchronize()
            out.seconds = start.elapsed_time(end) / 1e3


def model_size(device=None) -> str:
    """``"gpu"`` or ``"cpu"``: which of a chapter's model sizes to use
    (:data:`minipar.models.sizes.SIZES`)."""
    if device is None:
        from .backend import default_device, gpu_count
        return "gpu" if default_device() != "cpu" and gpu_count() else "cpu"
    return "gpu" if torch.device(device).type == "cuda" else "cpu"


def allocator_peaks(measured) -> list | None:
    """The caching allocator's peak bytes per rank, beside a chapter's own tensor count: from
    a run's per-rank ``measured`` dicts (``TrainResult.measured``; :func:`minipar.strategy.on_device`
    sets ``"gpu_peak_bytes"`` there on a GPU) or from plain numbers (``peak_memory().bytes``
    returned by rank functions). ``None`` when no rank ran on a GPU."""
    peaks = [m.get("gpu_peak_bytes") if isinstance(m, Mapping) else m for m in measured]
    return None if all(p is None for p in peaks) else peaks


def add_allocator_peaks(fig, x, measured, scale: float = 1, name: str = "allocator peak (GPU)",
                        secondary: str | None = None, **marker):
    """Add :func:`allocator_peaks` to a plotly memory figure as one series of markers at ``x``
    (bytes divided by ``scale``), only for a GPU run: on the CPU ``fig`` comes back unchanged.
    ``secondary="MiB"`` draws them on a right-hand axis of that title (with ``scale=2**20``),
    for figures whose own axis is not bytes. Returns ``fig``."""
    peaks = allocator_peaks(measured)
    if peaks is None:
        return fig
    style = dict(symbol="diamond", size=11, color="#9D755D") | marker
    fig.add_scatter(x=list(x), y=[None if p is None else p / scale for p in peaks], mode="markers",
                    name=name, marker=style, yaxis="y2" if secondary else None)
    if secondary:
        fig.update_layout(yaxis2=dict(overlaying="y", side="right", title=secondary, rangemode="tozero"))
    return fig
