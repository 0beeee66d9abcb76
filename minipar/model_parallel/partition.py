"""Cut a model's layers into pipeline stages of balanced cost.

A pipeline runs at the pace of its slowest stage: a GPipe/1F1B step takes
``(m + p - 1) · max_s c_s``, ``c_s`` the cost of stage s. With ``C = Σ c_s`` the best is
``c_s = C / p``; a split achieves the fraction

    balance = (C / p) / max_s c_s        (1.0 = perfect; 0.5 = the pipeline runs 2x slower)

:func:`partition` finds the contiguous split minimising ``max_s c_s`` exactly (a dynamic
programme over "first j layers in k stages", O(p·L²)) and, among those, the most even one
(least Σ c_s²); a layer's cost is its parameter count (a proxy for FLOPs and memory) or a time.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn


# Contract:
# Given: ``costs`` are L layers' costs; the result is the boundaries ``[0, b_1, ..., b_{p-1}, L]``
#     (stage s holds layers ``b_s`` to ``b_{s+1} - 1``). ``_min_max(prefix, p)`` gets the prefix
#     sums (``prefix[j]``: the cost of the first j layers) and returns the optimal cost of the
#     costliest stage.
# ex04.A.valid: p contiguous, non-empty stages, covering every layer once.
# ex04.A.optimal: the most expensive stage is as cheap as possible (any optimal split is
#     accepted; checked against brute force on random costs).
# ex04.A.range: raises ``ValueError`` unless 1 <= p <= L.
def partition(costs: list[float], p: int) -> list[int]:
    """Stage boundaries ``[0, b_1, ..., L]`` (stage s = layers ``b_s : b_{s+1}``, none empty)
    minimising the cost of the most expensive stage."""
    # >>> ex04 A
    L = len(costs)
    if p < 1:
        raise ValueError(f"need at least one stage, got p={p}")
    if p > L:
        raise ValueError(f"cannot cut {L} layers into {p} stages: more stages than layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    limit = _min_max(prefix, p)
    # among the splits whose stages all cost <= limit, take the most even one: the least
    # sum of squared stage costs (best[k][j] over "first j layers in k stages")
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(p + 1)]
    cut = [[0] * (L + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, L - (p - k) + 1):
            for i in range(k - 1, j):
                c = prefix[j] - prefix[i]
                if c <= limit * (1 + 1e-12) and best[k - 1][i] + c * c < best[k][j]:
                    best[k][j], cut[k][j] = best[k - 1][i] + c * c, i
    bounds, j = [L], L
    for k in range(p, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return bounds[::-1]
    # <<< ex04 A


def _min_max(prefix: list[float], p: int) -> float:
    """The smallest achievable cost of the most expensive of ``p`` contiguous stages, given the
    prefix sums of the layer costs (``prefix[j]``: the first j layers), by dynamic programming."""
    # >>> ex04 A
    L, inf = len(prefix) - 1, float("inf")
    best = [[inf] * (L + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, L - (p - k) + 1):
            best[k][j] = min(max(best[k - 1][i], prefix[j] - prefix[i]) for i in range(k - 1, j))
    return best[p][L]
    # <<< ex04 A


def stage_costs(costs: list[float], bounds: list[int]) -> list[float]:
    """Total cost of each stage."""
    return [float(sum(costs[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


def balance(costs: list[float], bounds: list[int]) -> float:
    """``(C / p) / max_s c_s``: 1.0 when every stage costs the same."""
    per = stage_costs(costs, bounds)
    return (sum(per) / len(per)) / max(per)


def explain(costs: list[float], bounds: list[int], unit: str = "") -> str:
    """A few lines: the layers and cost of each stage, and what the imbalance costs."""
    per = stage_costs(costs, bounds)
    lines = [f"stage {s}: layers {a}..{b - 1}  cost {c:,.4g}{unit}"
             for s, (a, b, c) in enumerate(zip(bounds[:-1], bounds[1:], per))]
    bal = balance(costs, bounds)
    lines.append(f"balance {bal:.2f}: the slowest stage costs {max(per) / (sum(per) / len(per)):.2f}x "
                 f"the average, so the steady state runs at {100 * bal:.0f}% of a perfect split")
    return "\n".join(lines)


def layer_costs(layers: list[nn.Module], by: str = "params", sample=None, repeats: int = 3) -> list[float]:
    """Per-layer cost: ``by="params"`` (parameter count) or ``"time"`` (seconds for forward
    and backward of ``sample`` through each layer in turn, median of ``repeats``)."""
    if by == "params":
        return [float(sum(q.numel() for q in layer.parameters())) for layer in layers]
    if by != "time":
        raise ValueError(f"by must be 'params' or 'time', got {by!r}")
    if sample is None:
        raise ValueError("by='time' needs a sample input for the first layer")
    return time_each_layer(layers, sample, repeats, lambda ts: sorted(ts)[len(ts) // 2])


def time_each_layer(layers, x, repeats: int, pick, last_loss=None) -> list[float]:
    """Seconds of forward + backward of each layer in turn: ``pick`` of the times of ``repeats``
    calls after a warm-up; the last layer's backward starts from ``last_loss(y)`` if given."""
    out = []
    for j, layer in enumerate(layers):
        x = x.detach().requires_grad_(x.is_floating_point())
        ts = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            y = layer(x)
            (last_loss(y) if last_loss and j == len(layers) - 1 else y.float().sum()).backward()
            ts.append(time.perf_counter() - t)
        layer.zero_grad(set_to_none=True)
        out.append(pick(ts[1:]))   # call 0 warms up (allocations, lazy initialisation)
        x = y
    return out


def build_stages(layers: list[nn.Module], bounds: list[int], rank: int, p: int) -> dict[int, nn.Module]:
    """The stages rank ``rank`` of ``p`` holds, ``{stage: nn.Sequential(its layers)}``:
    stages rank, rank+p, ... (more than one with virtual stages)."""
    n_stages = len(bounds) - 1
    if n_stages % p:
        raise ValueError(f"{n_stages} stages cannot be spread evenly over {p} ranks")
    return {s: nn.Sequential(*layers[bounds[s]:bounds[s + 1]]) for s in range(rank, n_stages, p)}


def owned_parameters(model: nn.Module, stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """``{name in model: parameter}`` for the parameters that live in ``stages``."""
    mine = {id(q) for st in stages.values() for q in st.parameters()}
    return {n: q for n, q in model.named_parameters() if id(q) in mine}


@torch.no_grad()
def boundary_shapes(layers, bounds: list[int], micro_input: torch.Tensor) -> dict[int, tuple]:
    """Shape of each stage's output for one micro-batch (runs the layers once)."""
    shapes, x = {}, micro_input
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        for layer in layers[a:b]:
            x = layer(x)
        shapes[s] = tuple(x.shape)
    return shapes
