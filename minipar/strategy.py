"""One shape for every strategy: ``check`` before launch, ``train`` on the ranks, ``run`` from
the driver.

Every strategy module of :data:`STRATEGIES` exposes the same three functions::

    check(model, batches, world_size, **options)              # plain ValueError, no process started
    train(model, batches, optimizer=None, group=None, **options) -> dict     # on every rank
    run(model, batches, world_size, optimizer=None, **options) -> TrainResult  # the driver

``check`` takes every option ``train`` takes and rejects any other by name (:func:`checks`);
``group`` is a parameter only where a group other than the world works (hybrid and expert
parallelism lay their mesh over the whole world and have none); ``recompute=None`` everywhere
means the model's own configuration. Each ``train`` writes only its step body and hands it to
:func:`loop`, the one step loop: timing, bytes by dimension, the loss record, ``measured``; its
forward runs in :func:`forward`, the one site of the compute dtype's autocast.

``model`` is the single-device model (same seed on every rank), ``batches`` the global
batches the single process trains on, ``optimizer`` a picklable factory
``params -> torch.optim.Optimizer`` (:func:`minipar.reference.sgd`, :func:`~minipar.reference.adamw`;
default SGD with lr 0.1). A rank's ``train`` returns::

    {"losses": [float, ...] or None,   # the global mean loss of every step (None on ranks that do not hold it)
     "params": {name: tensor} or None, # final parameters by single-device name, this rank's share of them
     "measured": Measured}             # what the last step measured on this rank (seconds, bytes, memory, extras)

and ``run`` merges the ranks' dicts into one :class:`TrainResult`, which
:func:`minipar.reference.assert_same_training` compares with the single process.
"""
from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from . import comm
from .measured import EXTRAS, Measured   # strategy.EXTRAS and strategy.Measured too
from .memory import held_state_bytes
from .models.recompute import apply_recompute, check_mode
from .precision import autocast, resolve
from .runtime import trace
from .runtime.backend import device
from .runtime.gpu import peak_memory
from .runtime.launch import launch
from .runtime.trace import Trace

STRATEGIES = ("data_parallel", "model_parallel", "pipeline", "tensor_parallel", "zero",
              "context_parallel", "expert_parallel", "hybrid", "adapt", "data_parallel.parameter_server")
"""Every strategy, by module name under ``minipar`` (each has ``check``, ``train`` and ``run``): the
top-level strategy modules, and the parameter server inside data parallelism's package."""


@dataclass
class TrainResult:
    """What a strategy's run gives back: the losses of every step, the final full
    parameters by single-device name, what each rank measured (rank order) and the trace."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    measured: list[Measured] = field(default_factory=list)
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
        return cls(list(losses), params, [r.get("measured") or Measured() for r in results],
                   getattr(results, "trace", None), results)


class _Whole:
    def __repr__(self):
        return "strategy.WHOLE"

    def __reduce__(self):      # one object in every process: pickled by its name
        return "WHOLE"


WHOLE = _Whole()
"""``loop(..., mean_over=WHOLE)``: no group averages the loss, the rank holds the whole step's
mean (every tensor-parallel rank computes it whole; a pipeline's last stage holds it, ``None``
elsewhere)."""


def record_loss(loss, mean_over, parts_over=WHOLE, dim: str | None = None):
    """The step's global mean loss from this rank's ``loss``, the loss record's one rule.

    ``parts_over``: the group whose ranks hold terms of one loss (pipeline stages: the last one's
    cross-entropy, every stage's auxiliary losses; or shares already divided by the ranks), summed;
    ``mean_over``: the group whose ranks hold the means of different shards of the batch (data,
    sequence), averaged after the sum, L = (1/|mean_over|) Σ_mean_over Σ_parts_over ℓ_r. ``None`` is the
    world, as in :mod:`minipar.comm`; a group of one rank is no all-reduce; ``dim`` labels the
    all-reduces (by default their group's own name). With both ``WHOLE`` the
    record is ``loss`` as the step returned it (a tensor, a float, or ``None`` on a rank without it);
    otherwise a one-element fp32 tensor on the rank's device (``None``: no part, 0), reduced by
    recorded all-reduces named ``"loss"``."""
    if mean_over is WHOLE and parts_over is WHOLE:
        return loss
    t = (loss.detach().float().reshape(1).clone() if isinstance(loss, torch.Tensor)
         else torch.tensor([loss or 0.0], device=device()))
    labels = {} if dim is None else {"dim": dim}
    for group, op in ((parts_over, "sum"), (mean_over, "avg")):
        if group is not WHOLE and comm.group_size(group) > 1:
            comm.all_reduce(t, op=op, group=group, name="loss", **labels)
    return t


def average_loss(loss: torch.Tensor, group=None, dim: str | None = None) -> float:
    """The ranks' mean of ``loss`` over ``group`` as a float (:func:`record_loss` with
    ``mean_over=group``; one wait for the device)."""
    return record_loss(loss, group, dim=dim).item()


def loop(batches, step, *, mean_over, parts_over=WHOLE, dim: str | None = None, events: bool = False,
         history: bool = False, after=None) -> tuple[list, Measured]:
    """The one step loop of every strategy: ``(losses, measured)`` of training on ``batches``.

    ``step(i, batch)`` is the strategy's step body (zero_grad, forward, backward, optimizer
    step). It returns the step's loss on this rank, or ``(loss, extra)``: ``extra`` is a dict of
    measured entries (``"memory"`` or names of :data:`EXTRAS`), or a function of the step's trace
    events returning one, evaluated on the last step only. The loop owns the rest, the same for
    every strategy:

    * ``seconds``: the step body's wall time (the loss record below is not part of it);
    * ``bytes_by_dim`` (with ``"total"``, also ``bytes_sent``): what this rank sent in the
      step by mesh dimension, read through the trace's public API
      (:func:`~minipar.runtime.trace.mark`, :func:`~minipar.runtime.trace.since`,
      :func:`~minipar.runtime.trace.bytes_by_dim`); ``events=True`` keeps the step's
      ``events`` too, ``history=True`` the ``step_seconds`` of every step;
    * the loss record, the step's global mean loss: the strategy says which group averages the
      ranks' losses (``mean_over``, required: a group, ``None`` for the world, or :data:`WHOLE`)
      and which sums their parts first (``parts_over``), :func:`record_loss` (``dim`` labels its
      all-reduces). Records stay tensors on the device during the loop and become floats once,
      after it (no wait for a GPU per step);
    * ``after(i, loss, seconds)``, if given: called after every step's record, as a float (one
      wait for the device per step), with the step's seconds; True ends the loop there (the
      training command's callback: one verdict on a NaN or a stop, progress, checkpoints, switches).

    ``measured`` is the last step's :class:`Measured` (its ``memory`` is the strategy's to fill,
    :func:`state_memory`)."""
    records, measured, seconds_each = [], Measured(), []
    n = len(batches) if hasattr(batches, "__len__") else None
    for i, batch in enumerate(batches):
        mark, t0 = trace.mark(), time.perf_counter()
        out = step(i, batch)
        seconds = time.perf_counter() - t0
        seconds_each.append(seconds)
        loss, extra = out if isinstance(out, tuple) else (out, {})
        if n is None or i == n - 1:
            evs = trace.since(mark)
            sent = trace.bytes_by_dim(evs)
            measured = Measured(seconds, sent)
            measured.update(extra(evs) if callable(extra) else extra)
            if events:
                measured["events"] = evs
            if history:
                measured["step_seconds"] = seconds_each
        records.append(record_loss(loss, mean_over, parts_over, dim))
        if after is not None:
            records[-1] = floats(records[-1:])[0]
            if after(i, records[-1], seconds):
                break
    return floats(records), measured


def floats(records: list) -> list:
    """``records`` with every tensor turned into a float, all in one copy from the device."""
    tensors = [r.reshape(()) for r in records if isinstance(r, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else ())
    return [next(values) if isinstance(r, torch.Tensor) else r for r in records]


def check_options(model, dtype=None, recompute=None) -> None:
    """The checks of the options every strategy takes: a known ``dtype``
    (:func:`minipar.precision.resolve`) and, unless ``None`` (the model's own), a known
    ``recompute`` mode on a model that has one (the GPT)."""
    resolve(dtype)
    if recompute is not None:
        if not hasattr(model, "set_recompute"):
            raise ValueError(f"recompute={recompute!r} needs a model with set_recompute (the GPT)")
        check_mode(recompute)


def checks(fn):
    """Decorator of a strategy's ``check``: an option it does not name is a plain ``ValueError``
    naming it (and the options there are), before any process starts."""
    sig = inspect.signature(fn)
    known = [k for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY
             or (p.kind is p.POSITIONAL_OR_KEYWORD and k not in ("model", "batches", "world_size"))]

    @functools.wraps(fn)
    def check(model, batches, world_size, *args, **options):
        unknown = [k for k in options if k not in sig.parameters]
        if unknown:
            raise ValueError(f"{fn.__module__.removeprefix('minipar.')}: unknown option "
                             f"{', '.join(map(repr, unknown))} (the options are {', '.join(known)})")
        return fn(model, batches, world_size, *args, **options)
    return check


def prepare(model, dtype=None, recompute=None) -> torch.dtype | None:
    """The options every strategy's ``train`` takes, decided once, in its first line
    (``dtype = strategy.prepare(model, dtype, recompute)``): ``recompute`` (unless ``None``, the
    model's own) is set on the model's blocks before the strategy builds anything from it
    (tensor-parallel shards, pipeline stages and sharded experts are built from the model's config,
    so they inherit it); the compute ``dtype`` is resolved (:func:`minipar.precision.resolve`) and
    returned, what every forward then enters autocast with, resolving nothing again. The
    composition of several dimensions decides both in its plan (:func:`minipar.hybrid.check`) and
    applies ``recompute`` in its own place (:func:`minipar.hybrid.parallelize`)."""
    if recompute is not None:
        apply_recompute(model, _Plan(recompute))
    return resolve(dtype)


@dataclass(frozen=True)
class _Plan:
    recompute: str | None


@contextmanager
def forward(dtype=None, on="cpu", region: str | None = None, **labels):
    """The one place a forward is entered: ``with strategy.forward(dtype, model, "forward", step=i):``.

    The block runs in the trace region ``region`` (labelled ``labels``; none if ``None``) around
    the mixed-precision rule's autocast (:func:`minipar.precision.autocast`) in ``dtype`` on the
    device of ``on`` (a device or its name, or a tensor or module computing there). Only the
    forward and its loss go inside; the backward runs outside, so no autograd Function's backward
    computes under autocast (its gradients come in the dtypes the forward saved)."""
    if isinstance(on, torch.nn.Module):
        on = next(on.parameters()).device
    elif isinstance(on, torch.Tensor):
        on = on.device
    with trace.region(region, **labels) if region is not None else nullcontext(), autocast(dtype, on):
        yield


def state_memory(module, optimizer=None, **counted) -> dict[str, int]:
    """``Measured.memory`` of a strategy whose rank holds plain modules and an optimizer:
    ``{"params", "grads", "optimizer", "total"}`` bytes of ``module``'s parameters, their gradients
    and ``optimizer``'s state on this rank (:func:`minipar.memory.held_state_bytes`, distinct
    storages), then ``counted`` (e.g. ``activations=``), outside the total."""
    return held_state_bytes(module, optimizer=optimizer) | counted


def full_params(named) -> dict[str, torch.Tensor]:
    """``{name: fp32 copy on the CPU}`` of ``module.named_parameters()`` (or any name/tensor pairs)."""
    return {k: v.detach().float().cpu().clone() for k, v in named}


def run(train, model, batches, world_size: int, *, check=None, optimizer=None,
        timeout: float = 120.0, launch_options: dict | None = None, **options) -> TrainResult:
    """Driver side of every strategy: ``check(model, batches, world_size, **options)``
    (a plain error before any process starts), then ``train`` on ``world_size`` ranks, merged."""
    if check is not None:
        check(model, batches, world_size, **options)
    params = inspect.signature(train).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in options if k not in params or k in ("model", "batches", "optimizer", "group")]
        if unknown:  # an option only check takes (e.g. seq_len): nothing the ranks could use
            raise ValueError(f"{train.__module__.removeprefix('minipar.')}.train takes no option "
                             f"{', '.join(map(repr, unknown))}")
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
    here = device()
    with peak_memory(here) as peak:   # one path: moving to the CPU is a no-op, the peak None there
        out = train(to_device(model, here), to_device(batches, here), **options)
    if peak.bytes is not None and isinstance(out, dict) and isinstance(out.get("measured"), Measured):
        out["measured"]["gpu_peak_bytes"] = peak.bytes
    if isinstance(out, dict):  # where it ran: assert_same_training's tolerance floor
        out.setdefault("device", str(here))
    return out
