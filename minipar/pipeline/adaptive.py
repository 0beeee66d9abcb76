"""Adaptive re-partitioning: measure each layer on its stage, cut again, move the layers.

A pipeline runs at the pace of its slowest stage (:mod:`.partition`). A cut balanced by
parameter count is wrong whenever cost is not proportional to parameters: an embedding
has many parameters and almost no compute, a large-vocabulary head spends its time in the
loss, a rank may sit on a slower device. :func:`train_adaptive` fixes the cut while training
(``minipar.pipeline.run(model, batches, p, probe_steps=k)``, an option of the pipeline's own API):

1. train ``probe_steps`` steps on the first cut (default: by parameter count);
2. every rank times each of its layers, forward and backward, on the inputs its stage
   really received (the last layer with the loss), and the times are summed over the
   pipeline group (an all-reduce of one float per layer): the cost of every layer *on the
   rank that runs it*;
3. every rank computes the same new cut, :func:`~minipar.pipeline.partition` on the
   times (the ``by="time"`` costs of :func:`~minipar.pipeline.layer_costs`, measured in place);
4. each layer that changes rank goes from its old owner to its new one, parameters and
   optimizer state, by the plan of moves and its one all-to-all (:mod:`minipar.moves`, the
   mechanism of chapter 12's live switch; ``name="repartition"``), and training goes on with
   the new stages and an optimizer holding the moved state.

The arithmetic of a step does not depend on the cut, so the losses stay those of the
uninterrupted single-process run; only the time per step changes.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import comm, moves, strategy
from ..comm import group_rank, group_size
from ..models import lm_loss
from ..reference import sgd
from .executor import Pipeline
from ..model_parallel.partition import boundary_shapes, build_stages, layer_costs, owned_parameters, partition, time_each_layer
from .schedules import make_schedule


def time_layers(layers, x, targets=None, loss_fn=lm_loss, repeats: int = 5) -> list[float]:
    """Seconds of forward + backward of each layer in turn on input ``x``: the fastest of
    ``repeats`` after one warm-up (the least disturbed by other work); with ``targets`` the
    last layer includes the loss."""
    last_loss = None if targets is None else (lambda y: loss_fn(y, targets))
    return time_each_layer(layers, x, repeats, min, last_loss)


def owners(bounds: list[int], p: int) -> list[int]:
    """Rank of each layer under ``bounds`` (stage s on rank s % p)."""
    return [s % p for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) for _ in range(a, b)]


def move_layers(layers, old: list[int], new: list[int], optimizer, group=None) -> dict:
    """Move every layer whose rank changes from ``old`` to ``new`` bounds, parameters and
    optimizer state, from its old owner to its new one, with the plan of moves and its one
    all-to-all that chapter 12's live switch uses too (:func:`minipar.moves.move`, events named
    ``"repartition"``): a rank's holding is its layers' tensors, each one run of the index space
    laid out layer by layer; a layer that stays is a local copy and is not sent. Every rank holds
    the full model, so receivers write into their own copies. Returns ``{param: state dict}``
    received."""
    p, me = group_size(group), group_rank(group)
    ref_q, ref = next(((q, st) for q, st in optimizer.state.items() if st), (None, {}))  # keys, shapes
    slots = sorted(ref)
    shapes = {k: None if ref[k].shape == ref_q.shape else ref[k].shape for k in slots}   # None: the parameter's
    was, will = owners(old, p), owners(new, p)
    entries, at = [], 0                     # (layer, parameter, slot or None, offset, size) in index order
    for j, layer in enumerate(layers):
        for q in layer.parameters():
            for k in [None] + slots:
                size = q.numel() if k is None or shapes[k] is None else math.prod(shapes[k])
                entries.append((j, q, k, at, size))
                at += size

    def runs(owner):
        return [np.array([[o, n] for j, _, _, o, n in entries if owner[j] == r], np.int64).reshape(-1, 2)
                for r in range(p)]

    def tensor(q, k, state):
        return q.data if k is None else state[k]
    mine_old = [e for e in entries if was[e[0]] == me]
    flat_old = (torch.cat([tensor(q, k, optimizer.state[q]).reshape(-1) for _, q, k, _, _ in mine_old]) if mine_old
                else torch.empty(0, device=ref_q.device if ref_q is not None else None))
    mine_new = [e for e in entries if will[e[0]] == me]
    flat_new = torch.empty(sum(n for *_, n in mine_new), dtype=flat_old.dtype, device=flat_old.device)
    moves.move(runs(was), runs(will), flat_old, flat_new, group, name="repartition")
    received, i = {}, 0
    for j, q, k, _, n in mine_new:
        if was[j] != me:                 # arrived: into this rank's copy of the parameter, a new state
            state = received.setdefault(q, {})
            if k is None:
                q.data.copy_(flat_new[i:i + n].view_as(q.data))
            else:
                state[k] = flat_new[i:i + n].clone().view(q.shape if shapes[k] is None else shapes[k])
        i += n
    return received


def train_adaptive(model, batches, optimizer=None, group=None, schedule: str = "1f1b",
                   microbatches: int | None = None, probe_steps: int = 2, bounds: list[int] | None = None,
                   dtype=None) -> dict:
    """Run on every rank of ``group``: pipeline training that re-partitions after ``probe_steps``
    steps (module docstring); :func:`minipar.pipeline.train` with ``probe_steps=`` calls it, and
    ``pipeline.run(model, batches, p, probe_steps=k)`` launches it. Returns ``losses`` (rank of the
    last stage), this rank's final ``params`` and ``measured``: ``bounds_before``/``bounds_after``,
    ``layer_times``, ``step_seconds`` of every step, ``events_before``/``events_after`` (this rank's
    last step on each cut), and the last step's ``seconds`` and ``bytes_by_dim``, with the final
    cut's ``memory`` (a :class:`~minipar.strategy.Measured`)."""
    p, me = group_size(group), group_rank(group)
    layers, make = model.layers(), optimizer or sgd()
    sched = make_schedule(schedule, p, microbatches or p, 1, len(layers))
    micro_x, micro_y = batches[0][0].chunk(sched.m)[0], batches[0][1].chunk(sched.m)[0]

    def build(cut, state=None):
        stages = build_stages(layers, cut, me, p)
        pipe = Pipeline(stages, sched, boundary_shapes(layers, cut, micro_x).__getitem__, group, dtype=dtype)
        opt = make(list(pipe.parameters()))
        opt.state.update(state or {})
        return stages, pipe, opt

    cut = bounds or partition(layer_costs(layers), p)
    now = dict(zip(("stages", "pipe", "opt"), build(cut)))
    seen = {}

    def keep_input(module, args):        # the stage's first real input, for timing its layers
        seen.setdefault("x", args[0].detach())

    def step(i, batch):
        now["opt"].zero_grad(set_to_none=True)
        loss = now["pipe"].step(*batch)
        now["opt"].step()
        return loss

    hook = layers[cut[me]].register_forward_pre_hook(keep_input)
    losses, before = strategy.loop(batches[:probe_steps], step, mean_over=strategy.WHOLE, events=True, history=True)
    hook.remove()
    out = {"bounds_before": cut, "step_seconds": before.get("step_seconds", []),
           "events_before": before.get("events", [])}
    if probe_steps < len(batches):       # steps remain: time, re-cut, move, go on
        last = cut[me + 1] == len(layers)
        ts = time_layers(layers[cut[me]:cut[me + 1]], seen["x"], micro_y if last else None)
        times = torch.tensor([0.0] * cut[me] + ts + [0.0] * (len(layers) - cut[me + 1]),
                             dtype=torch.float64, device=seen["x"].device)
        comm.all_reduce(times, group=group, name="layer_times")
        new = partition(times.tolist(), p)
        opt = now["opt"]
        kept = {q: opt.state[q] for q in now["pipe"].parameters() if q in opt.state}
        moved = move_layers(layers, cut, new, opt, group)
        cut = new
        now.update(zip(("stages", "pipe", "opt"), build(cut, {**kept, **moved})))
        more, after = strategy.loop(batches[probe_steps:], step, mean_over=strategy.WHOLE, events=True,
                                     history=True)
        losses += more
        out.update(layer_times=times.tolist(), bounds_after=cut,
                   step_seconds=out["step_seconds"] + after["step_seconds"])
        before = after
    out["events_after"] = before.get("events", [])
    memory = strategy.state_memory(now["pipe"], now["opt"])
    measured = strategy.Measured(before.seconds, before.bytes_by_dim, memory, out)
    return {"losses": losses if (len(cut) - 2) % p == me else None,     # the rank of the last stage
            "params": strategy.full_params(owned_parameters(model, now["stages"]).items()),
            "measured": measured}
