"""Choosing the communication backend and the device of each rank.

Two backends matter for this course:

* **Gloo** runs collectives on CPU tensors over TCP sockets. Any number of ranks can
  share one machine, which is why the course runs on a laptop.
* **NCCL** runs collectives on GPU tensors over NVLink/PCIe/InfiniBand. It needs one
  GPU per rank: two ranks on one GPU are rejected by NCCL itself.

``pick_backend("auto", n)`` takes NCCL when there are at least ``n`` GPUs, else Gloo,
and always says why.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "gloo", "nccl")


class BackendError(ValueError):
    """A backend that cannot run the requested number of ranks on this machine."""


def gpu_count() -> int:
    """Number of CUDA devices this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_backend(backend: str, world_size: int) -> tuple[str, str]:
    """Return ``(backend, reason)`` for ``world_size`` ranks on this machine.

    ``"auto"`` prefers NCCL with one GPU per rank and falls back to Gloo on CPU with a
    reason a learner can read. Forcing ``"nccl"`` without enough GPUs is an error here,
    before any process starts, instead of NCCL's own message from inside a rank.
    """
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = gpu_count()
    if backend == "gloo":
        return "gloo", "Gloo on CPU (asked for explicitly)"
    if backend == "nccl":
        if not torch.distributed.is_nccl_available():
            raise BackendError("backend='nccl' was requested but this PyTorch build has no NCCL "
                               "(a CPU-only build?). Use backend='gloo' or 'auto'.")
        if gpus < world_size:
            raise BackendError(
                f"backend='nccl' needs one GPU per rank: {world_size} ranks requested but "
                f"{gpus} GPU(s) visible. NCCL cannot put two ranks on one GPU. Use fewer ranks, "
                f"or backend='gloo' (CPU) / 'auto'.")
        return "nccl", f"NCCL with one GPU per rank ({gpus} GPUs visible)"
    # auto
    if gpus >= world_size and torch.distributed.is_nccl_available():
        return "nccl", f"NCCL with one GPU per rank ({gpus} GPUs >= {world_size} ranks)"
    if gpus == 0:
        return "gloo", "Gloo on CPU (no CUDA GPU visible)"
    return "gloo", (f"Gloo on CPU: {world_size} ranks but only {gpus} GPU(s), and NCCL "
                    f"cannot put two ranks on one GPU")


def process_group_backend(backend: str) -> str:
    """The string for ``init_process_group``: under NCCL, CPU tensors still go through
    Gloo (``"cpu:gloo,cuda:nccl"``), so code that keeps some tensors on the CPU, as most
    of this course does, works on GPUs too."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def device_for_rank(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under Gloo."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def current_device() -> torch.device:
    """The device of the calling rank (inside ``minipar.launch`` or ``torchrun``)."""
    import torch.distributed as dist
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def describe_machine(world_sizes=(2, 4)) -> list[tuple[str, str]]:
    """Rows (what, value) describing this machine and the backend each world size gets."""
    import platform

    import torch.distributed as dist
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CPU cores", str(os.cpu_count())), ("CUDA GPUs", str(gpu_count())),
            ("Gloo available", str(dist.is_gloo_available())),
            ("NCCL available", str(dist.is_nccl_available()))]
    for n in world_sizes:
        rows.append((f"backend for {n} ranks", pick_backend("auto", n)[1]))
    return rows
