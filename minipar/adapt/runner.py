"""The adaptive run: one object decides, after every step, whether the job changes layout.

:class:`Adaptive` holds the current :class:`~minipar.hybrid.HybridModel` and, after each step
(:meth:`Adaptive.after`), applies the run's policies in order:

1. **probing** (``--layout auto``): after ``probe`` steps on a candidate, its measured step time
   is logged beside the planner's prediction and the next candidate is switched to; after the
   last, the fastest measured (:mod:`.auto`);
2. **forced switches** (``--switch-at STEP=LAYOUT``);
3. **re-partitioning** (``--adapt-every N``): the layers' measured costs give a new pipeline
   cut, taken when its gain over the remaining steps pays for the switch (:mod:`.straggler`).

Every decision is computed from numbers every rank shares (all-reduced times), so every rank
switches at the same step to the same layout, and each is logged as a record with the
measurements that drove it: a probe's ``step_ms`` (each of its steps, the slowest rank's) and
``measured_ms`` (their median after the first) beside ``predicted_ms``; a re-partition's
``layer_ms`` (each layer's forward per step over ``measured_steps``, the slowest replica's), the
stage times they predict for both cuts, the gain over the remaining steps and the switch cost
it is weighed against (``switch_s``, and where it came from). ``build(layout, bounds)`` makes a model of a
layout; the state moves by :func:`~minipar.adapt.switch.reshard`, and each switch's record holds
the α, β of this machine's all-to-all (``alpha_beta``, measured once, at the first switch:
:func:`exchange_alpha_beta`) and the switch's time over that exchange's α-β time (``over_alpha_beta``). :func:`minipar.adapt.train` and
``python -m minipar.train`` both drive it."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..pipeline import partition
from .auto import decide, slowest_median
from .layout import parse
from .straggler import LayerClock, costs, slow_down, worth_it
from .switch import measure_exchange, reshard


class Adaptive:
    def __init__(self, build, steps: int, switches=None, proposed=(), probe: int = 3, slow=None,
                 adapt_every: int | None = None, switch_cost: float | None = None):
        self.build, self.steps, self.switches = build, steps, dict(switches or {})
        self.proposed = [dict(r, layout=parse(r["layout"])) if isinstance(r, dict)
                         else {"layout": parse(r), "predicted_ms": None} for r in proposed]
        self.probe, self.slow, self.adapt_every, self.switch_cost = probe, slow, adapt_every, switch_cost
        self.hm = self.layout = self.clock = None
        self.build_seconds = 0.0
        self.alpha_beta = None
        self.seconds, self.records, self.decisions, self.repartitions = [], [], [], []

    def first_layout(self, given):
        return self.proposed[0]["layout"] if self.proposed else parse(given)

    def into(self, layout, step: int, bounds=None):
        """Build ``layout`` (with the pipeline cut ``bounds``) and move the state into it."""
        t0 = time.perf_counter()
        new = self.build(layout, bounds)
        built = time.perf_counter() - t0
        if self.hm is None:             # the first build: what a switch's rebuild will cost, at least
            self.build_seconds = built
        if self.slow is not None and dist.get_rank() == self.slow[0]:
            slow_down([layer for st in new.stages.values() for layer in st], self.slow[1])
        if self.hm is not None:
            if self.alpha_beta is None:         # measured once, at the first switch, at this world
                self.alpha_beta = exchange_alpha_beta(self.hm)
            self.records.append({"step": step, "from": str(self.layout), "to": str(layout),
                                 "bounds": list(new.bounds), "build_seconds": built,
                                 "alpha_beta": list(self.alpha_beta)} | reshard(self.hm, new, self.alpha_beta))
        self.hm, self.layout = new, layout
        self.clock = LayerClock(new) if self.adapt_every else None
        return new

    def after(self, done: int, seconds: float):
        """The policies after step ``done`` (counted from 1) took ``seconds``. Returns the model."""
        self.seconds.append(seconds)
        k, p = len(self.proposed), self.probe
        if k and done <= k * p and done % p == 0:
            row = self.proposed[done // p - 1]
            steps = torch.tensor(self.seconds[-p:], dtype=torch.float64, device=self.hm.device)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)           # each probe step, the slowest rank's
            self.decisions.append({"layout": str(row["layout"]), "predicted_ms": row["predicted_ms"],
                                   "measured_ms": 1e3 * slowest_median(self.seconds[-p:], self.hm.device),
                                   "step_ms": [1e3 * t for t in steps.tolist()], "steps": [done - p + 1, done],
                                   "rule": "the median of the probe's steps after the first, the slowest rank's; "
                                           "the fastest candidate is kept"})
            if done // p < k:
                self.into(self.proposed[done // p]["layout"], done)
            elif decide(self.decisions)["layout"] != str(self.layout):
                self.into(parse(decide(self.decisions)["layout"]), done)
        if done in self.switches:
            self.into(self.switches[done], done)
        if self.adapt_every and done % self.adapt_every == 0:
            self._repartition(done)
        return self.hm

    def _repartition(self, done: int) -> None:
        hm, clock = self.hm, self.clock
        c = costs(clock, self.adapt_every)
        clock.reset()
        if hm.mesh.pp == 1 or done >= self.steps:
            return
        new = partition(c, len(hm.bounds) - 1)
        past = [r["seconds"] + r["build_seconds"] for r in self.records]   # the rebuild is part of it
        guess = max(past) if past else 1.5 * self.build_seconds    # no switch measured yet
        if self.switch_cost is not None:
            guess = self.switch_cost
        cost_s = torch.tensor([guess], dtype=torch.float64)
        dist.all_reduce(cost_s, op=dist.ReduceOp.MAX)     # one decision on every rank
        d = {"step": done, "layer_ms": [1e3 * x for x in c], "measured_steps": [done - self.adapt_every + 1, done],
             "switch_s_from": "given" if self.switch_cost is not None else "the costliest switch so far" if past
             else "1.5 × the first build"} | worth_it(c, hm.bounds, new, self.steps - done, float(cost_s))
        self.repartitions.append(d)
        if d["switch"]:
            self.into(self.layout, done, bounds=new)

    def log(self) -> dict:
        return {"switches": self.records, "decisions": self.decisions, "repartitions": self.repartitions,
                "step_seconds": self.seconds, "layout": str(self.layout), "bounds": list(self.hm.bounds)}


def exchange_alpha_beta(hm) -> tuple[float, float]:
    """α, β of this machine's all-to-all at this world (:func:`~.switch.measure_exchange`), on sizes
    up to a rank's share of the model's weights and two slots of optimizer state in fp32 (what a
    switch's busiest rank moves at most, about)."""
    share = 3 * 4 * sum(math.prod(s) for s in hm.full_shapes.values()) // dist.get_world_size()
    sizes = sorted({1 << 10, 1 << 16, max(share // 8, 1 << 17), max(share // 2, 1 << 18)})
    return measure_exchange(sizes, repeats=3, device=hm.device)
