"""One shape for every strategy: ``check`` before launch, ``train`` on the ranks, ``run`` from
the driver.

Every strategy package (``data_parallel``, ``pipeline``, ``tensor_parallel``, ``zero``,
``hybrid``, ``context_parallel``, ``expert_parallel``) exposes the same three functions::

    check(model, batches, world_size, **options)              # plain ValueError, no process started
    train(model, batches, optimizer=None, group=None, **options) -> dict     # on every rank
    run(model, batches, world_size, optimizer=None, **options) -> TrainResult  # the driver

``model`` is the single-device model (same seed on every rank), ``batches`` the global
batches the single process trains on, ``optimizer`` a picklable factory
``params -> torch.optim.Optimizer`` (:func:`minipar.reference.sgd`, :func:`~minipar.reference.adamw`;
default SGD with lr 0.1). A rank's ``train`` returns::

    {"losses": [float, ...] or None,   # the global mean loss of every step (None on ranks that do not hold it)
     "params": {name: tensor} or None, # final parameters by single-device name, this rank's share of them
     "measured": {...}}                # what the last step measured on this rank (bytes, memory, seconds, ...)

and ``run`` merges the ranks' dicts into one :class:`TrainResult`, which
:func:`minipar.reference.assert_same_training` compares with the single process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .runtime.launch import launch
from .runtime.trace import Trace


@dataclass
class TrainResult:
    """What a strategy's run gives back: the losses of every step, the final full
    parameters by single-device name, what each rank measured (rank order) and the trace."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    measured: list[dict] = field(default_factory=list)
    trace: Trace | None = None
    results: list | None = field(default=None, repr=False)

    def __getitem__(self, key):  # so ``assert_same_training(result, reference)`` reads it like a dict
        return getattr(self, key)

    @property
    def placement(self):
        """Where the ranks ran (:class:`minipar.runtime.backend.Placement`; ``None`` if not launched)."""
        return getattr(self.results, "placement", None)

    @classmethod
    def merge(cls, results) -> "TrainResult":
        """One result from the ranks' ``train`` dicts: the first rank's losses that are not
        ``None``, every rank's parameters (shares of a model merge into the whole)."""
        losses = next((r["losses"] for r in results if r.get("losses") is not None), [])
        params = {k: v for r in results for k, v in (r.get("params") or {}).items()}
        return cls(list(losses), params, [r.get("measured", {}) for r in results],
                   getattr(results, "trace", None), results)


def average_loss(loss: torch.Tensor, group=None, op: str = "avg", **labels) -> float:
    """The step's loss for the record: ``loss`` all-reduced over ``group`` with ``op``
    (``"avg"``: the ranks' mean losses; ``"sum"``: losses already divided by the ranks), one
    tiny recorded all-reduce named ``"loss"``."""
    from . import comm
    t = loss.detach().float().reshape(1).clone()
    comm.all_reduce(t, op=op, group=group, name="loss", **labels)
    return t.item()


def full_params(named) -> dict[str, torch.Tensor]:
    """``{name: fp32 copy on the CPU}`` of ``module.named_parameters()`` (or any name/tensor pairs)."""
    return {k: v.detach().float().cpu().clone() for k, v in named}


def run(train, model, batches, world_size: int, *, check=None, optimizer=None,
        timeout: float = 120.0, launch_options: dict | None = None, **options) -> TrainResult:
    """Driver side of every strategy: ``check(model, batches, world_size, **options)``
    (a plain error before any process starts), then ``train`` on ``world_size`` ranks, merged."""
    if check is not None:
        check(model, batches, world_size, **options)
    return TrainResult.merge(launch(on_device, world_size, args=(train, model, batches),
                                    kwargs=dict(optimizer=optimizer, **options), timeout=timeout,
                                    **(launch_options or {})))


def to_device(obj, device):
    """``obj`` (a module, a tensor, or lists/tuples/dicts of them) on ``device``."""
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def on_device(train, model, batches, **options):
    """Rank side of :func:`run`: the model and the batches arrive on the CPU; put them where
    this rank computes (:func:`minipar.device`) and train there. On a GPU, ``measured`` also
    gets ``"gpu_peak_bytes"``: the caching allocator's peak over the run on this rank
    (:func:`minipar.runtime.gpu.peak_memory`), to show beside the formula and minipar's own count;
    a dict result gets ``"device"``, where it trained."""
    from .runtime.backend import device
    from .runtime.gpu import peak_memory
    here = device()
    if here.type == "cpu":
        out = train(model, batches, **options)
    else:
        with peak_memory(here) as peak:
            out = train(to_device(model, here), to_device(batches, here), **options)
        if isinstance(out, dict) and isinstance(out.get("measured"), dict):
            out["measured"]["gpu_peak_bytes"] = peak.bytes
    if isinstance(out, dict):  # where it ran: assert_same_training's tolerance floor
        out.setdefault("device", str(here))
    return out
