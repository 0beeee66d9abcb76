"""Train a layered model with a pipeline schedule, in the shape of :mod:`minipar.strategy`.

* :func:`check` (driver, before any process starts): a plain ``ValueError`` for a
  configuration the pipeline cannot run;
* :func:`train` (every rank of ``group``): every rank builds the same model (same seed),
  keeps the stages it owns, and trains them with :class:`~minipar.pipeline.Pipeline`;
* :func:`run` (driver): ``check``, then ``train`` on ``world_size`` ranks, merged into one
  :class:`~minipar.strategy.TrainResult` (each rank's parameters are its stages', the
  merge unions them), which :func:`minipar.reference.assert_same_training` compares with
  the single process.
"""
from __future__ import annotations

from .. import strategy
from ..runtime.backend import device
from ..comm import group_rank, group_size
from ..reference import sgd
from .executor import Pipeline
from .adaptive import train_adaptive
from ..model_parallel.partition import boundary_shapes, build_stages, layer_costs, owned_parameters, partition
from .schedules import Schedule, make_schedule


def _schedule(schedule, p: int, microbatches, virtual_stages: int, n_layers: int) -> Schedule:
    """The :class:`Schedule` to run: ``schedule`` itself, or the one of that name."""
    if isinstance(schedule, Schedule):
        if schedule.p != p:
            raise ValueError(f"{schedule} is for p={schedule.p} ranks, but there are {p}")
        if microbatches not in (None, schedule.m):
            raise ValueError(f"{schedule} has m={schedule.m}, but microbatches={microbatches}")
        return schedule
    return make_schedule(schedule, p, microbatches or p, virtual_stages, n_layers)


@strategy.checks
def check(model, batches, world_size: int, schedule="1f1b", microbatches: int | None = None,
          virtual_stages: int = 1, bounds: list[int] | None = None, dtype=None, recompute=None,
          probe_steps: int | None = None) -> None:
    """Raise a plain ``ValueError`` before launch: a schedule that cannot run (:func:`check_config`),
    a batch that does not cut into m micro-batches, ``bounds`` that are not ``p·v`` stages of
    the model's layers, an unknown dtype, recomputation for a model without it, re-partitioning
    (``probe_steps``, :mod:`.adaptive`) with virtual stages or a schedule object."""
    n_layers = len(model.layers())
    sched = _schedule(schedule, world_size, microbatches, virtual_stages, n_layers)
    for k, (x, _) in enumerate(batches):
        if x.shape[0] % sched.m:
            raise ValueError(f"batch {k} has {x.shape[0]} sequences: "
                             f"not divisible into m={sched.m} micro-batches")
    if bounds is not None and not (len(bounds) == sched.n_stages + 1 and bounds[0] == 0
                                   and bounds[-1] == n_layers
                                   and all(a < b for a, b in zip(bounds[:-1], bounds[1:]))):
        raise ValueError(f"bounds {bounds} must be {sched.n_stages + 1} increasing cuts from 0 to "
                         f"{n_layers} ({sched.n_stages} non-empty stages)")
    strategy.check_options(model, dtype, recompute)
    if probe_steps is not None:
        if not isinstance(probe_steps, int) or probe_steps < 1:
            raise ValueError(f"probe_steps must be a positive int (steps before re-partitioning), got {probe_steps!r}")
        if sched.n_stages != world_size or not isinstance(schedule, str):
            raise ValueError("re-partitioning (probe_steps=) moves whole stages of one rank each: "
                             "use virtual_stages=1 and a schedule by name")


def train(model, batches, optimizer=None, group=None, schedule="1f1b", microbatches: int | None = None,
          virtual_stages: int = 1, bounds: list[int] | None = None, dtype=None, recompute=None,
          probe_steps: int | None = None) -> dict:
    """Run on every rank of ``group``: cut ``model.layers()`` at ``bounds`` (default:
    balanced by parameter count) into ``p·virtual_stages`` stages, train this rank's with
    ``schedule`` (a name: "gpipe", "1f1b", "interleaved", "zb-h1", or a :class:`Schedule`)
    on ``microbatches`` micro-batches (default p) per batch; forwards in ``dtype`` (autocast,
    :mod:`minipar.precision`), with the GPT's activation ``recompute`` mode (``None``: the model's
    own). ``probe_steps=k``: re-partition by measured time after k steps (:func:`.adaptive.train_adaptive`).
    Returns ``losses`` (on the rank holding the last stage, else ``None``), this rank's ``params``
    by single-device name, and ``measured``: the last step's ``peak_stash``, ``bytes_sent`` (this
    rank's messages, from the trace), ``bytes_by_dim`` and ``seconds`` (:func:`minipar.strategy.loop`),
    and the ``bounds`` used."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    model = model.to(device())                 # this rank's copy, where the rank computes
    if probe_steps is not None:
        return train_adaptive(model, batches, optimizer, group, schedule, microbatches, probe_steps, bounds,
                              dtype)
    layers = model.layers()
    sched = _schedule(schedule, group_size(group), microbatches, virtual_stages, len(layers))
    bounds = bounds or partition(layer_costs(layers), sched.n_stages)
    if len(bounds) - 1 != sched.n_stages:
        raise ValueError(f"{len(bounds) - 1} stages in bounds, the schedule has {sched.n_stages}")
    stages = build_stages(layers, bounds, group_rank(group), sched.p)
    shapes = boundary_shapes(layers, bounds, batches[0][0].chunk(sched.m)[0].to(device()))
    pipe = Pipeline(stages, sched, shapes.__getitem__, group, dtype=dtype)
    opt = (optimizer or sgd())(list(pipe.parameters()))

    def step(i, batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(x.to(device()), y.to(device()))  # the last stage's float, None elsewhere
        opt.step()
        return loss, {"peak_stash": pipe.peak_stash}

    losses, measured = strategy.loop(batches, step, mean_over=strategy.WHOLE)
    measured.update(memory=strategy.state_memory(pipe, opt), bounds=bounds)
    return {"losses": losses if sched.n_stages - 1 in stages else None,
            "params": strategy.full_params(owned_parameters(model, stages).items()),
            "measured": measured}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks, merged into one
    :class:`~minipar.strategy.TrainResult` (``measured[r]`` is rank r's)."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
