"""Training that changes layout while it runs, in the shape of every strategy (:mod:`minipar.strategy`).

``layout`` is the first layout; ``switches`` are ``(STEP, LAYOUT)`` pairs (or ``"STEP=LAYOUT"``
texts): after step STEP the job builds the new layout's mesh and :class:`~minipar.hybrid.HybridModel`
and :func:`~minipar.adapt.switch.reshard`\\ s the state into it, then goes on. Every layout
trains on the same global batches, so the losses continue those of one process across every
switch (the test: ``tests/test_adapt.py``)."""
from __future__ import annotations

import copy

import torch.distributed as dist

from .. import hybrid, strategy
from .layout import check as check_layout, parse, parse_switches, same_step
from .runner import Adaptive
from .straggler import parse_slow


def segments(layout, switches, steps: int):
    """``[(first step, last step + 1, Layout)]`` of a run of ``steps`` steps."""
    sw = parse_switches(switches, steps)
    starts = [(0, parse(layout))] + sw
    ends = [s for s, _ in sw] + [steps]
    return [(a, b, lay) for (a, lay), b in zip(starts, ends)]


@strategy.checks
def check(model, batches, world_size: int | None, layout="dp=1", switches=(), candidates=(),
          probe: int = 3, slow_rank=None, adapt_every: int | None = None, switch_cost: float | None = None,
          dtype=None, recompute=None,
          schedule: str = "1f1b", sequence_parallel: bool = False, bucket_cap_mb: float = 25.0) -> None:
    """Plain errors before any process starts: every layout's product is ``world_size``, every switch
    lies inside the run, the candidates' probes fit in it, and the hybrid options fit every layout."""
    steps = len(batches) if batches is not None else None
    if candidates:
        if probe < 2:
            raise ValueError(f"probe = {probe}: a candidate needs at least 2 steps (the first is a warm-up)")
        if steps is not None and len(candidates) * probe > steps:
            raise ValueError(f"{len(candidates)} candidates × {probe} probe steps exceed the run's {steps} steps")
        lays = [parse(c["layout"] if isinstance(c, dict) else c) for c in candidates]
    else:
        lays = [lay for _, _, lay in (segments(layout, switches, steps) if steps else [(0, 0, parse(layout))])]
    slow = parse_slow(slow_rank)
    if slow is not None and world_size is not None and slow[0] >= world_size:
        raise ValueError(f"slow rank {slow[0]}: the job has ranks 0..{world_size - 1}")
    if adapt_every is not None and (adapt_every < 1 or candidates):
        raise ValueError("adapt_every: a positive number of steps, not combined with candidates")
    batch = batches[0][0].shape[0] if batches else None
    options = dict(dtype=dtype, recompute=recompute, schedule=schedule, sequence_parallel=sequence_parallel,
                   bucket_cap_mb=bucket_cap_mb)
    for lay in lays:
        if world_size is not None:
            check_layout(lay, world_size, batch)
        hybrid.check(model, batches, world_size, dp=lay.dp, pp=lay.pp, tp=lay.tp, cp=lay.cp, ep=lay.ep,
                     **lay.options(), **options)
    config = getattr(model, "config", model)
    for old, new in zip(lays, lays[1:]):
        why = same_step(old, new, config)
        if why is not None:
            raise ValueError(f"switch {old} -> {new}: {why}")


def train(model, batches, optimizer=None, layout="dp=1", switches=(), candidates=(), probe: int = 3,
          slow_rank=None, adapt_every: int | None = None, switch_cost: float | None = None, dtype=None,
          recompute=None, schedule: str = "1f1b", sequence_parallel: bool = False,
          bucket_cap_mb: float = 25.0) -> dict:
    """Rank function: train ``model`` on ``batches`` through every layout of the run. Returns the
    losses of every step, the final single-device parameters (on rank 0) and ``measured``: the
    last step's, plus ``switches`` (this rank's record of each switch: step, layouts, bytes by the
    plan and as observed, ``build_seconds`` of the new model and the reshard's ``seconds`` and
    ``phases``) and ``step_seconds`` of every step.

    ``candidates`` (layouts, or :func:`~minipar.adapt.auto.propose`'s rows): train ``probe`` steps
    on each in turn, then the rest on the one measured fastest (:func:`~minipar.adapt.auto.decide`);
    ``measured["decisions"]`` is the log. ``layout`` and ``switches`` are then not used. The other
    options are :class:`~minipar.hybrid.HybridModel`'s, the same in every layout.

    ``slow_rank="R:F"`` makes rank R's compute F times slower (:func:`~minipar.adapt.straggler.slow_down`);
    ``adapt_every=N`` times every layer every N steps and, under a pipeline, moves to the cut of the
    measured costs when the gain pays for the switch (``switch_cost`` seconds; ``None``: the
    costliest switch so far, its rebuild included, before any 1.5 × the first build) (:func:`~minipar.adapt.straggler.worth_it`;
    ``measured["repartitions"]`` is the log)."""
    options = dict(dtype=dtype, recompute=recompute, schedule=schedule, sequence_parallel=sequence_parallel,
                   bucket_cap_mb=bucket_cap_mb)

    def build(lay, bounds):
        return hybrid.HybridModel(copy.deepcopy(model), lay.mesh(), optimizer=optimizer, bounds=bounds,
                                  **lay.options(), **options)
    run_ = Adaptive(build, len(batches), parse_switches(switches, len(batches)), candidates, probe,
                    parse_slow(slow_rank), adapt_every, switch_cost)
    hm = run_.into(run_.first_layout(layout), 0)
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append(hm.train_step(x, y))
        last = hm.last_step                       # the step's record, before any switch after it
        hm = run_.after(i + 1, last["seconds"])
    full = hm.full_state_dict()
    names = [k for k, _ in model.named_parameters()]
    measured = strategy.Measured(last["seconds"], last["bytes"], hm.memory(),
                                 {"events": last["events"], **run_.log(), "coords": hm.coords})
    return {"losses": losses, "measured": measured,
            "params": strategy.full_params((k, full[k]) for k in names) if dist.get_rank() == 0 else None}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
