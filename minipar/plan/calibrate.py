"""Calibrate the planner: fit its efficiency on published runs, or measure this machine.

* :func:`fit_efficiency` — the one free parameter of :func:`minipar.plan.step_time`, the
  achievable fraction of peak, such that predicted and observed throughputs agree on a few
  runs: the root of Σ log(predicted/observed) (over- and under-prediction equal in ratio).
* :func:`fit_roofline` — the roofline's two numbers (:class:`~minipar.plan.roofline.Efficiency`:
  ``f_max`` and ``x_half``) minimising Σ log²(predicted/observed) over a few runs (a grid,
  then a finer one around its best point).
* :func:`measure_machine` — α and β of this machine's all-reduce (:func:`time_all_reduces`, also
  the timing loop of ``python -m minipar.bench collectives``; :func:`minipar.cost.fit_alpha_beta`), the roofline's
  two CPU rates (GEMM FLOP/s by shape, memory bandwidth) and a timed GPT block's dispatch
  overhead, as a :class:`~minipar.plan.Cluster`.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from .. import comm, cost
from ..cost.flops import layer_forward_flops
from ..models.gpt import Block
from ..runtime import launch as launching   # called as launching.launch: looked up when called (tests replace it)
from ..runtime.backend import device
from ..runtime.gpu import synchronize
from . import roofline
from .hardware import Accelerator, Cluster
from .layout import Layout
from .models import from_gpt_config
from .roofline import Efficiency, backward, layer_ops, ops_time


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


GEMM_SHAPES = ((32, 32, 32), (64, 96, 32), (256, 32, 32), (128, 128, 128), (256, 256, 256), (512, 512, 512))


def _median(f, repeats: int) -> float:
    times = []
    for k in range(repeats + 1):                 # round 0 warms up
        synchronize()
        t = time.perf_counter()
        f()
        synchronize()
        if k:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def rates(config, micro_batch: int = 4, repeats: int = 7) -> dict:
    """Rank function (or plain call): the roofline's rates where this rank computes, medians of
    ``repeats``: GEMM FLOP/s at :data:`GEMM_SHAPES` (``{(m, n, k): FLOP/s}``), memory bandwidth
    (bytes/s of a 16 MB copy: read + write), and one GPT block's forward + backward at ``micro_batch``."""
    dev = device()
    gemm = {}
    for m, n, k in GEMM_SHAPES:
        a, b = torch.randn(m, k, device=dev), torch.randn(k, n, device=dev)
        gemm[(m, n, k)] = 2 * m * n * k / _median(lambda: torch.mm(a, b), repeats)
    x = torch.randn(4 * 2 ** 20, device=dev)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / _median(lambda: y.copy_(x), repeats)
    block = Block(config).to(dev)
    h = torch.randn(micro_batch, config.block_size, config.n_embd, requires_grad=True, device=dev)
    return {"gemm": gemm, "bandwidth": bw,
            "block": _median(lambda: block(h).sum().backward(), repeats), "micro_batch": micro_batch}


def fit_gemm_curve(gemm: dict, bandwidth: float):
    """``(peak, Efficiency(1, x_half))`` from measured GEMM rates: the peak is the fastest shape's
    rate, ``x_half`` the least-squares fit (in log) of the roofline curve over the shapes."""
    peak = max(gemm.values())
    ops = {shape: roofline.gemm("g", *shape, 4) for shape in gemm}

    def loss(x_half):
        eff = roofline.Efficiency(1.0, x_half)
        return sum(math.log(min(peak, o.intensity * bandwidth) * eff.fraction(o.intensity, peak / bandwidth)
                            / gemm[s]) ** 2 for s, o in ops.items())
    grid = [i / 50 for i in range(0, 201)]               # x_half from 0 to 4 ridges
    return peak, roofline.Efficiency(1.0, min(grid, key=loss))


def time_all_reduces(sizes: list[int], repeats: int) -> dict:
    """Rank function: fastest seconds per size (of ``repeats``, after one warm-up round) of each
    all-reduce, minipar's ring (and recursive halving-doubling for a power-of-two world) and the
    backend's own, calls interleaved; ``"backend"``: the one that moves tensors on this rank's
    device ("gloo" or "nccl"). The timing loop of ``python -m minipar.bench collectives`` too."""
    n = dist.get_world_size()
    backend = "nccl" if comm.p2p.moved_by_nccl(torch.empty(0, device=device()), None) else "gloo"
    impls = {"ring": comm.ring_all_reduce, backend: dist.all_reduce}
    if n & (n - 1) == 0:
        impls["halving_doubling"] = comm.halving_doubling_all_reduce
    out = {k: [] for k in impls}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=device())
        times = {k: [] for k in impls}
        for rep in range(repeats + 1):  # round 0 warms up
            for k, f in impls.items():  # interleaved: ring, gloo, ring, gloo, ...
                dist.barrier()
                synchronize()           # the clock read after the device finished what was queued
                t = time.perf_counter()
                f(x)
                synchronize()
                if rep:
                    times[k].append(time.perf_counter() - t)
        for k in impls:  # the fastest repeat: the one least disturbed by other work
            out[k].append(min(times[k]))
    return {"backend": backend, "seconds": out}


def measure_rank(sizes, repeats, config, micro_batch):
    out = time_all_reduces(sizes, repeats)
    out["rates"] = rates(config, micro_batch)   # every rank at once: the cores are shared as in training
    return out


SIZES = [2 ** k for k in (12, 16, 20)]


def measure_machine(config, world_size: int = 4, sizes=None, micro_batch: int = 4) -> dict:
    """``{"alpha", "beta", "flops", "bandwidth", "efficiency", "overhead", "cluster"}`` measured here
    in a few seconds, on ``world_size`` ranks at once (the cores are shared as in training):

    * α, β of Gloo's all-reduce at a few sizes (:func:`minipar.cost.fit_alpha_beta`);
    * the roofline's two CPU rates (:func:`rates`): GEMM FLOP/s by shape (peak and ``x_half``,
      :func:`fit_gemm_curve`) and memory bandwidth, the slowest rank's;
    * ``overhead``: one GPT block's measured forward + backward minus what the roofline gives it at
      those rates: the operator dispatch a tiny model's step is made of (``layer_overhead``).

    The cluster has ``cores`` = this machine's CPU count: with more ranks than cores a rank waiting
    in the pipeline's bubble lends its core to the others (:func:`minipar.plan.step_time`)."""
    sizes = sizes or SIZES
    res = launching.launch(measure_rank, world_size, args=(sizes, 5, config, micro_batch), timeout=180)
    return machine_from(res, config, sizes, micro_batch)


def median_of_rounds(rounds: list[dict]) -> dict:
    """One rank's :func:`measure_rank` results of several rounds, each number their median."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: median_of_rounds([r[k] for r in rounds]) for k in first}
    if isinstance(first, list):
        return [median_of_rounds([r[i] for r in rounds]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sorted(rounds)[len(rounds) // 2]
    return first


def machine_from(res: list[dict], config, sizes=None, micro_batch: int = 4) -> dict:
    """:func:`measure_machine`'s result from each rank's :func:`measure_rank` (or
    :func:`median_of_rounds` of several, taken between other work)."""
    sizes, world_size = sizes or SIZES, len(res)
    native = res[0]["backend"]                # the library's own all-reduce: Gloo here, NCCL on GPUs
    ts = [max(r["seconds"][native][i] for r in res) for i in range(len(sizes))]
    alpha, beta = cost.fit_alpha_beta("all_reduce", sizes, ts, world_size)
    if beta <= 0:   # latency swamped the sizes (a loaded machine): bound β by the largest message
        beta = ts[-1] / cost.collective_bytes("all_reduce", sizes[-1], world_size)
    shapes = res[0]["rates"]["gemm"]
    gemm = {s: min(r["rates"]["gemm"][s] for r in res) for s in shapes}
    bandwidth = min(r["rates"]["bandwidth"] for r in res)
    peak, eff = fit_gemm_curve(gemm, bandwidth)
    block = sorted(r["rates"]["block"] for r in res)[len(res) // 2]
    gpu = Accelerator("this-cpu", peak, 64e9, 1 / beta, "shared memory (Gloo)", hbm_bw=bandwidth, kind="cpu",
                      efficiency=eff, source="measured by minipar.plan.calibrate")
    lay = Layout(micro_batch=micro_batch, dtype="fp32", sequence_parallel=False)
    ops = layer_ops(from_gpt_config(config), lay, config.block_size, "materialized")
    overhead = max(0.0, block - ops_time(ops + backward(ops), gpu))
    gpu = replace(gpu, layer_overhead=overhead)
    cluster = Cluster("this-machine", gpu, world_size, 1, 1 / beta, alpha_intra=alpha, alpha_inter=alpha,
                      network="none", source="measured by minipar.plan.calibrate", cores=os.cpu_count() or 1)
    return {"alpha": alpha, "beta": beta, "flops": peak, "bandwidth": bandwidth, "efficiency": eff,
            "gemm": gemm, "overhead": overhead, "cluster": cluster}
