"""A straggler, and the pipeline that gives it less to do.

**The fault.** :func:`slow_down` makes one rank's compute ``factor`` times slower: after each of
its layers' forward it sleeps (factor − 1)·3·t_forward, the layer's forward and backward
(≈ 3 forwards: the backward computes two products for each one of the forward) stretched by
``factor``. A sleeping rank holds no core, as a slower GPU would not. ``--slow-rank R:F`` injects
it, beside the other faults of :mod:`minipar.production.faults`.

**The answer.** A synchronous job runs at the pace of its slowest rank. Under pipeline
parallelism the step time is set by the costliest stage, max_s Σ_{l ∈ s} c_l (Narayanan et al.
2019), so the cut can move layers off a slow rank: :class:`LayerClock` times every layer on the
rank that runs it (the slow rank's layers measure slow), :func:`costs` combines the ranks'
times (one all-reduce of one float per layer, the slowest replica's), and
:func:`~minipar.pipeline.partition` on the measured costs gives the new cut. :func:`worth_it`
switches only when the gain over the remaining steps exceeds the switch's own cost."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def parse_slow(text) -> tuple[int, float] | None:
    """``"1:3"`` → ``(1, 3.0)``: rank 1, three times slower."""
    if text is None or isinstance(text, tuple):
        return text
    rank, colon, factor = str(text).partition(":")
    try:
        r, f = int(rank), float(factor)
    except ValueError:
        r, f = -1, 0.0
    if not colon or r < 0 or f < 1:
        raise ValueError(f"slow rank {text!r}: expected RANK:FACTOR with FACTOR ≥ 1, e.g. 1:3")
    return r, f


def slow_down(layers, factor: float) -> list:
    """Stretch every module of ``layers`` by ``factor`` (module docstring). Returns the hook handles."""
    handles = []
    for layer in layers:
        def pre(module, args):
            module._slow_t0 = time.perf_counter()

        def post(module, args, out, factor=factor):
            time.sleep((factor - 1) * 3 * (time.perf_counter() - module._slow_t0))
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


class LayerClock:
    """Seconds each of a :class:`~minipar.hybrid.HybridModel`'s layers spent in forward on this rank
    (summed over micro-batches and steps since :meth:`reset`), by global layer index."""

    def __init__(self, hm):
        self.n = hm.bounds[-1]
        self.seconds = [0.0] * self.n
        self.handles = []
        for s, stage in hm.stages.items():
            for j, layer in enumerate(stage, start=hm.bounds[s]):
                self.handles += [layer.register_forward_pre_hook(self._start),
                                 layer.register_forward_hook(lambda m, a, o, j=j: self._stop(j))]

    def _start(self, module, args):
        self._t0 = time.perf_counter()

    def _stop(self, j):
        self.seconds[j] += time.perf_counter() - self._t0

    def reset(self):
        self.seconds = [0.0] * self.n

    def remove(self):
        for h in self.handles:
            h.remove()


def costs(clock: LayerClock, steps: int) -> list[float]:
    """Each layer's forward seconds per step on the rank that runs it, the slowest replica's
    (an all-reduce MAX over the world of one float per layer: a layer a rank does not run is 0)."""
    t = torch.tensor(clock.seconds, dtype=torch.float64) / max(steps, 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def stage_costs(c: list[float], bounds: list[int]) -> list[float]:
    """Σ of ``c`` over each stage of ``bounds``."""
    return [sum(c[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def worth_it(c: list[float], old: list[int], new: list[int], remaining: int, switch_seconds: float) -> dict:
    """The decision: the predicted gain per step (3× the forward costs: forward and backward) of
    cutting at ``new`` instead of ``old``, and whether ``remaining`` steps of it pay for a switch of
    ``switch_seconds``."""
    before, after = 3 * max(stage_costs(c, old)), 3 * max(stage_costs(c, new))
    gain = (before - after) * remaining
    return {"bounds_before": list(old), "bounds_after": list(new), "stage_ms_before": 1e3 * before,
            "stage_ms_after": 1e3 * after, "gain_s": gain, "switch_s": switch_seconds,
            "switch": new != list(old) and gain > switch_seconds}
