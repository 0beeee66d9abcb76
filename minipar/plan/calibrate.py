"""Calibrate the planner: fit its efficiency on published runs, or measure this machine.

* :func:`fit_efficiency` — the one free parameter of :func:`minipar.plan.step_time`, the
  achievable fraction of peak, such that predicted and observed throughputs agree on a few
  runs: the root of Σ log(predicted/observed) (over- and under-prediction equal in ratio).
* :func:`fit_roofline` — the roofline's two numbers (:class:`~minipar.plan.roofline.Efficiency`:
  ``f_max`` and ``x_half``) minimising Σ log²(predicted/observed) over a few runs (a grid,
  then a finer one around its best point).
* :func:`measure_machine` — α and β of this machine's all-reduce (the timing loop of
  ``python -m minipar.bench collectives``, :func:`minipar.cost.fit_alpha_beta`) and the
  FLOP/s of a timed GPT block, as a :class:`~minipar.plan.Cluster` with that peak (efficiency 1).
"""
from __future__ import annotations

import math
import time

from .hardware import Accelerator, Cluster


def fit_efficiency(predict_at, observed: list[float], lo: float = 1e-3, hi: float = 1.0) -> float:
    """Efficiency e with Σ_i log(predict_at(e)[i] / observed[i]) = 0 (bisection; the
    prediction grows with e)."""
    def g(e):
        return sum(math.log(p / o) for p, o in zip(predict_at(e), observed))
    if g(hi) < 0:
        return hi
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if g(mid) < 0 else (lo, mid)
    return (lo * hi) ** 0.5


def fit_roofline(predict_at, observed: list[float], f_range=(0.3, 1.0), x_range=(0.0, 2.0),
                 steps: int = 15, rounds: int = 3):
    """``Efficiency(f_max, x_half)`` minimising Σ_i log²(predict_at(eff)[i] / observed[i])."""
    from .roofline import Efficiency

    def loss(f, x):
        return sum(math.log(p / o) ** 2 for p, o in zip(predict_at(Efficiency(f, x)), observed))
    (f0, f1), (x0, x1) = f_range, x_range
    best = None
    for _ in range(rounds):
        grid = [(f0 + (f1 - f0) * i / (steps - 1), x0 + (x1 - x0) * j / (steps - 1))
                for i in range(steps) for j in range(steps)]
        best = min(grid, key=lambda fx: loss(*fx))
        df, dx = (f1 - f0) / (steps - 1), (x1 - x0) / (steps - 1)
        f0, f1 = max(f_range[0], best[0] - df), min(f_range[1], best[0] + df)
        x0, x1 = max(x_range[0], best[1] - dx), min(x_range[1], best[1] + dx)
    return Efficiency(round(best[0], 3), round(best[1], 3))


def timed_block(config, batches=(1, 8), repeats: int = 5) -> dict:
    """Rank function (or plain call): seconds of one GPT block's forward and backward at two
    batch sizes, fitted as ``t = overhead + FLOPs / rate`` (the α-β idea for compute)."""
    import torch

    from ..cost.flops import layer_forward_flops
    from ..models.gpt import Block
    from ..backend import device
    from ..gpu import synchronize
    block = Block(config).to(device())                      # timed where this rank computes
    pts = []
    for b in batches:
        x = torch.randn(b, config.block_size, config.n_embd, requires_grad=True,
                        device=block.ln1.weight.device)
        times = []
        for k in range(repeats + 1):
            synchronize()
            t = time.perf_counter()
            block(x).sum().backward()
            synchronize()
            if k:
                times.append(time.perf_counter() - t)
        pts.append((3 * layer_forward_flops(b, config.block_size, config.n_embd), sorted(times)[len(times) // 2]))
    (f1, t1), (f2, t2) = pts
    per_flop = max((t2 - t1) / (f2 - f1), 1e-15)
    return {"rate": 1 / per_flop, "overhead": max(t1 - f1 * per_flop, 0.0)}


def _measure_rank(sizes, repeats, config):
    from ..bench.collectives import measure
    out = measure(sizes, repeats)
    out["block"] = timed_block(config)       # every rank at once: the cores are shared as in training
    return out


def measure_machine(config, world_size: int = 4, sizes=None) -> dict:
    """``{"alpha", "beta", "flops", "overhead", "cluster"}`` measured here in a few seconds: all-reduce
    times at a few sizes on ``world_size`` ranks (α, β by :func:`minipar.cost.fit_alpha_beta`), and
    a GPT block of ``config`` timed on every rank at once (rate, per-layer overhead: :func:`timed_block`)."""
    from .. import cost
    from ..launch import launch
    sizes = sizes or [2 ** k for k in (12, 16, 20)]
    res = launch(_measure_rank, world_size, args=(sizes, 3, config), timeout=120)
    ts = [max(r["gloo"][i] for r in res) for i in range(len(sizes))]
    alpha, beta = cost.fit_alpha_beta("all_reduce", sizes, ts, world_size)
    if beta <= 0:   # latency swamped the sizes (a loaded machine): bound β by the largest message
        beta = ts[-1] / cost.collective_bytes("all_reduce", sizes[-1], world_size)
    rate = min(r["block"]["rate"] for r in res)
    overhead = max(r["block"]["overhead"] for r in res)
    bw = 1 / beta
    gpu = Accelerator("this-cpu", rate, 64e9, bw, "shared memory (Gloo)",
                      source="measured by minipar.plan.calibrate", layer_overhead=overhead)
    cluster = Cluster("this-machine", gpu, world_size, 1, bw, alpha_intra=alpha, alpha_inter=alpha,
                      network="none", source="measured by minipar.plan.calibrate")
    return {"alpha": alpha, "beta": beta, "flops": rate, "overhead": overhead, "cluster": cluster}
