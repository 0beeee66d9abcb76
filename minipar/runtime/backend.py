"""Where the ranks compute and how they talk: one decision, made once, before any process starts.

Two backends matter here. **Gloo** runs collectives on CPU tensors over TCP sockets; any
number of ranks can share one machine, which is why the course runs on a laptop. **NCCL** runs
them on GPU tensors over NVLink/PCIe/InfiniBand and needs one GPU per rank (NCCL itself rejects
two ranks on one GPU). :func:`place` turns ``(world_size, device, backend)`` and the GPUs of
this machine into a :class:`Placement`, with a sentence saying why:

=================  ==========================================================================
GPUs visible       ``device="auto"`` gives
=================  ==========================================================================
``>= n``           NCCL, one GPU per rank (rank r on ``cuda:r``)
``1 .. n-1``       the ranks *share* the GPUs: rank r computes on ``cuda:(r % G)``, and
                   communication goes over Gloo through host memory (correct, not fast)
``0``              Gloo on the CPU
=================  ==========================================================================

``device="cpu"`` forces the CPU; ``device="cuda"`` with no GPU is an error here, before any
process starts. Inside a rank, :func:`device` says where to compute.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
DEVICE_ENV = "MINIPAR_DEVICE"  # set in every rank by launch; in the driver it sets the default


class BackendError(ValueError):
    """A device or backend that cannot run the requested number of ranks on this machine."""


def gpu_count() -> int:
    """Number of CUDA devices this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


@dataclass(frozen=True)
class Placement:
    """Where ``world_size`` ranks compute (``device``: "cpu" or "cuda", over ``gpus`` GPUs)
    and which backend carries their messages; ``reason`` is the sentence ``launch`` prints."""

    world_size: int
    backend: str  # "gloo" | "nccl"
    device: str   # "cpu" | "cuda"
    gpus: int     # GPUs the ranks use (0 on the CPU)
    reason: str

    @property
    def shared(self) -> bool:
        """Several ranks compute on one GPU (their messages are staged through host memory)."""
        return self.device == "cuda" and self.gpus < self.world_size

    def device_for_rank(self, local_rank: int) -> torch.device:
        """``cuda:(r % G)`` on GPUs, else the CPU."""
        return torch.device("cuda", local_rank % self.gpus) if self.device == "cuda" else torch.device("cpu")


def place(world_size: int, device: str = "auto", backend: str = "auto",
          gpus: int | None = None) -> Placement:
    """The placement of ``world_size`` ranks on this machine (or on one with ``gpus`` GPUs:
    pass a number to see what a bigger machine would do). Raises :class:`BackendError` for a
    request this machine cannot serve, before any process starts."""
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device not in DEVICES:
        raise BackendError(f"device must be one of {DEVICES}, got {device!r}")
    g = gpu_count() if gpus is None else int(gpus)
    nccl_ok = gpus is not None or torch.distributed.is_nccl_available()  # simulated: has NCCL
    n = world_size
    if device == "cpu" or (device == "auto" and backend == "gloo"):
        if backend == "nccl":
            raise BackendError("backend='nccl' runs on GPUs only; device='cpu' needs backend='gloo' or 'auto'")
        why = "device='cpu' asked for" if device == "cpu" else "asked for explicitly"
        return Placement(n, "gloo", "cpu", 0, f"Gloo on CPU ({why})")
    if backend == "nccl":
        if not nccl_ok:
            raise BackendError("backend='nccl' was requested but this PyTorch build has no NCCL "
                               "(a CPU-only build?). Use backend='gloo' or 'auto'.")
        if g < n:
            raise BackendError(f"backend='nccl' needs one GPU per rank: {n} ranks requested but {g} GPU(s) "
                               "visible. NCCL cannot put two ranks on one GPU. Use fewer ranks, or "
                               "backend='auto' (ranks share the GPUs over Gloo) / device='cpu'.")
    if g == 0:
        if device == "cuda":
            cpu_only = "" if torch.backends.cuda.is_built() else " (this PyTorch is a CPU-only build)"
            raise BackendError(f"device='cuda' was requested but no CUDA GPU is visible{cpu_only}. Use "
                               "device='auto' or 'cpu', or run on a machine with a GPU (on Colab: "
                               "Runtime > Change runtime type > GPU).")
        return Placement(n, "gloo", "cpu", 0, "Gloo on CPU (no CUDA GPU visible)")
    if g >= n and backend != "gloo" and nccl_ok:
        return Placement(n, "nccl", "cuda", n,
                         f"NCCL with one GPU per rank ({_plural(g, 'GPU')} >= {_plural(n, 'rank')})")
    if g >= n:  # backend="gloo" with device="cuda", or no NCCL in this PyTorch
        why = "asked for" if backend == "gloo" else "this PyTorch has no NCCL"
        return Placement(n, "gloo", "cuda", n,
                         f"one GPU per rank, communication over Gloo through host memory ({why})")
    where = "cuda:0" if g == 1 else f"cuda:(rank % {g})"
    return Placement(n, "gloo", "cuda", g,
                     f"{_plural(n, 'rank')} share {_plural(g, 'GPU')}: compute on {where}, "
                     f"communication over Gloo through host memory (correct, not NCCL's speed)")


def default_device() -> str:
    """``device="auto"`` unless ``MINIPAR_DEVICE`` says ``cpu`` or ``cuda`` (``course.py test --gpu``)."""
    d = os.environ.get(DEVICE_ENV, "auto").split(":")[0]
    return d if d in DEVICES else "auto"


def pick_backend(backend: str, world_size: int, device: str = "auto") -> tuple[str, str]:
    """``(backend, reason)`` of :func:`place` (kept for code written before placements)."""
    p = place(world_size, device, backend)
    return p.backend, p.reason


def process_group_backend(backend: str) -> str:
    """The string for ``init_process_group``: under NCCL, CPU tensors still go through
    Gloo (``"cpu:gloo,cuda:nccl"``), so code that keeps some tensors on the CPU, as most
    of this course does, works on GPUs too."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init_options(backend: str, here) -> dict:
    """Extra ``init_process_group`` arguments for a rank computing on ``here``: under NCCL its
    ``device_id``, which binds the group to that GPU and builds NCCL's communicator at once
    (eagerly) rather than at the first operation."""
    here = torch.device(here)
    return {"device_id": here} if "nccl" in backend and here.type == "cuda" else {}


def gpu_identity(here) -> str:
    """``"host GPU-uuid"``: which physical GPU of which machine ``here`` is (a CPU: unique)."""
    import socket
    here = torch.device(here)
    if here.type != "cuda":
        return f"{socket.gethostname()} cpu {os.getpid()}"
    try:
        gpu = str(torch.cuda.get_device_properties(here).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        gpu = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'all')} index {here.index}"
    return f"{socket.gethostname()} {gpu}"


def refuse_shared_gpus(store, rank: int, world_size: int, identity: str, here="cuda") -> None:
    """Under torchrun each agent places its ranks by ``LOCAL_RANK`` alone, so several agents
    on one machine (a simulated multi-node run) put ranks of different "nodes" on the same
    GPUs, which NCCL refuses ("Duplicate GPU detected"). Every rank posts ``identity``
    (:func:`gpu_identity`) to ``store``; a GPU named twice is a :class:`BackendError` naming
    the ranks, before the process group is made."""
    store.set(f"minipar/gpu/{rank}", identity)
    keys = [f"minipar/gpu/{r}" for r in range(world_size)]
    store.wait(keys)
    same = [r for r, k in enumerate(keys) if store.get(k).decode() == identity]
    if len(same) > 1 and torch.device(here).type == "cuda":
        raise BackendError(
            f"ranks {same} would all compute on {here}, the same GPU of {identity.split()[0]}: "
            "torchrun started several agents on one machine and each places its ranks by "
            "LOCAL_RANK. Give each agent its own GPUs (CUDA_VISIBLE_DEVICES=0 for one, =1 for the "
            "next, ...) or pass --device cpu (device='cpu').")


def device_for_rank(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under Gloo."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def device() -> torch.device:
    """Where the calling rank computes: ``cuda:k`` or ``cpu``, as :func:`minipar.runtime.launch` placed
    it (under ``torchrun``: the local GPU under NCCL). In the driver: the CPU, or the device
    that ``MINIPAR_DEVICE`` names (so a single-process reference runs where the ranks do)."""
    d = os.environ.get(DEVICE_ENV)
    if d and d != "auto":
        if d == "cuda":
            return torch.device("cuda", torch.cuda.current_device()) if gpu_count() else torch.device("cpu")
        return torch.device(d)
    import torch.distributed as dist
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


current_device = device  # the older name


def ranks_device() -> torch.device:
    """Where :func:`minipar.runtime.launch`'s ranks compute by default on this machine (``cuda:0``'s
    kind when there is a GPU, else the CPU; ``MINIPAR_DEVICE`` first): where a single-process
    reference must run to be compared with them (:func:`minipar.reference.train_reference`)."""
    d = os.environ.get(DEVICE_ENV)
    if d and d != "auto":
        return device()
    try:
        return place(1, default_device()).device_for_rank(0)
    except BackendError:
        return torch.device("cpu")


def describe_machine(world_sizes=(2, 4)) -> list[tuple[str, str]]:
    """Rows (what, value) describing this machine and the placement each world size gets."""
    import platform

    import torch.distributed as dist
    g = gpu_count()
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CPU cores", str(os.cpu_count())), ("CUDA GPUs", str(g))]
    if g:
        rows += [(f"cuda:{i}", torch.cuda.get_device_name(i)) for i in range(g)]
    rows += [("Gloo available", str(dist.is_gloo_available())),
             ("NCCL available", str(dist.is_nccl_available()))]
    return rows + [(_plural(n, "rank"), place(n).reason) for n in world_sizes]


def summary(world_sizes=(2, 4, 8)) -> str:
    """A few lines for a notebook's setup cell: torch, the GPUs, and each world size's placement."""
    g, gpus = gpu_count(), "no GPU"
    if g:
        names = sorted({torch.cuda.get_device_name(i) for i in range(g)})
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        gpus = f"{_plural(g, 'GPU')} ({', '.join(names)}, {mem:.0f} GiB)"
    lines = [f"minipar on torch {torch.__version__}, {os.cpu_count()} CPU cores, {gpus}"]
    lines += [f"  {_plural(n, 'rank')}: {place(n).reason}" for n in world_sizes]
    return "\n".join(lines)
