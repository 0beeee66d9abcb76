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
from ..mesh import ProcessMesh
from .layout import check as check_layout, parse, parse_switches
from .switch import reshard


def segments(layout, switches, steps: int):
    """``[(first step, last step + 1, Layout)]`` of a run of ``steps`` steps."""
    sw = parse_switches(switches, steps)
    starts = [(0, parse(layout))] + sw
    ends = [s for s, _ in sw] + [steps]
    return [(a, b, lay) for (a, lay), b in zip(starts, ends)]


def check(model, batches, world_size: int | None, layout="dp=1", switches=(), **options) -> None:
    """Plain errors before any process starts: every layout's product is ``world_size``, every switch
    lies inside the run, and the hybrid options fit every layout."""
    if getattr(getattr(model, "config", model), "moe_every", 0):
        raise ValueError("a live switch moves dense GPTs (moe_every = 0)")
    steps = len(batches) if batches is not None else None
    parts = segments(layout, switches, steps) if steps else [(0, 0, parse(layout))]
    batch = batches[0][0].shape[0] if batches else None
    for _, _, lay in parts:
        if world_size is not None:
            check_layout(lay, world_size, batch)
        hybrid.check(model, batches, world_size, dp=lay.dp, pp=lay.pp, tp=lay.tp, cp=lay.cp,
                     **lay.options(), **options)


def train(model, batches, optimizer=None, layout="dp=1", switches=(), **options) -> dict:
    """Rank function: train ``model`` on ``batches`` through every layout of the run. Returns the
    losses of every step, the final single-device parameters (on rank 0) and ``measured``: the
    last step's, plus ``switches`` (this rank's record of each switch: step, layouts, bytes by the
    plan and as observed, seconds) and ``step_seconds`` of every step."""
    losses, records, seconds, hm, measured = [], [], [], None, {}
    for start, end, lay in segments(layout, switches, len(batches)):
        mesh = ProcessMesh(dp=lay.dp, pp=lay.pp, tp=lay.tp, cp=lay.cp).build()
        new = hybrid.HybridModel(copy.deepcopy(model), mesh, optimizer=optimizer, **lay.options(), **options)
        if hm is not None:
            records.append({"step": start, "from": str(previous), "to": str(lay)} | reshard(hm, new))
        hm, previous = new, lay
        part, measured = strategy.loop(batches[start:end], lambda i, b: hm.step(*b),
                                       reduce=hm.reduce_loss, history=True)
        losses += part
        seconds += measured.pop("step_seconds", [])
    full = hm.full_state_dict()
    names = [k for k, _ in model.named_parameters()]
    measured |= {"switches": records, "step_seconds": seconds, "coords": hm.coords}
    return {"losses": losses, "measured": measured,
            "params": strategy.full_params((k, full[k]) for k in names) if dist.get_rank() == 0 else None}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
