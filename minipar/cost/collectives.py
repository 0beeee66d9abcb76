"""Cost of collectives: bytes per rank and the α-β time model.

Bytes each rank **sends** under the ring algorithm for a message of N bytes on n ranks
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", 2009; Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005):

    all_reduce       2 (n-1)/n · N      (reduce-scatter, then all-gather)
    reduce_scatter     (n-1)/n · N      (N = size of the full input)
    all_gather         (n-1)/n · N      (N = size of the full output)
    broadcast          (n-1)/n · N      (on average: (n-1)·N in total, shared by the senders)

The α-β (latency-bandwidth, "Hockney") model charges α seconds per message step and β
seconds per byte: T = steps·α + bytes·β, steps = 2(n-1) for the ring all-reduce, else n-1.
"""
from __future__ import annotations

import math

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def _check(op: str, world_size: int) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def collective_bytes(op: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends for ``op`` on a message of ``nbytes`` over ``world_size`` ranks."""
    _check(op, world_size)
    return (2 if op == "all_reduce" else 1) * (world_size - 1) / world_size * nbytes


def collective_steps(op: str, world_size: int, algorithm: str = "ring") -> int:
    """Sequential message steps: ring 2(n-1) for all-reduce and n-1 otherwise;
    ``"tree"``/``"halving_doubling"`` ⌈log2 n⌉ per phase."""
    _check(op, world_size)
    if world_size == 1:
        return 0
    per_phase = world_size - 1 if algorithm == "ring" else math.ceil(math.log2(world_size))
    return 2 * per_phase if op == "all_reduce" else per_phase


def alpha_beta_time(op: str, nbytes: float, world_size: int, alpha: float, beta: float,
                    algorithm: str = "ring") -> float:
    """Predicted seconds: ``steps·alpha + bytes_sent·beta`` (β in seconds per byte)."""
    return (collective_steps(op, world_size, algorithm) * alpha
            + collective_bytes(op, nbytes, world_size) * beta)


def fit_alpha_beta(op: str, sizes: list[float], seconds: list[float], world_size: int,
                   algorithm: str = "ring") -> tuple[float, float]:
    """(α, β) that best explain measured times of ``op`` at several message sizes: minimises
    the *relative* error Σ((T_model - t)/t)², so small and large messages count alike (times
    span orders of magnitude), with α, β ≥ 0."""
    xs = [(collective_steps(op, world_size, algorithm), collective_bytes(op, s, world_size))
          for s in sizes]

    def solve(cols):
        # weighted normal equations, weights 1/t², over the chosen columns (0: α, 1: β)
        w = [1 / t ** 2 for t in seconds]
        a = [[sum(wi * x[i] * x[j] for wi, x in zip(w, xs)) for j in cols] for i in cols]
        b = [sum(wi * x[i] * t for wi, x, t in zip(w, xs, seconds)) for i in cols]
        if len(cols) == 1:
            return [b[0] / a[0][0]] if a[0][0] else [0.0]
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        if det == 0:
            raise ValueError("need at least two different message sizes to fit alpha and beta")
        return [(b[0] * a[1][1] - b[1] * a[0][1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det]

    alpha, beta = solve([0, 1])
    if alpha < 0:
        alpha, beta = 0.0, solve([1])[0]
    elif beta < 0:
        alpha, beta = solve([0])[0], 0.0
    return alpha, beta


def bus_bandwidth(op: str, nbytes: float, world_size: int, seconds: float) -> float:
    """Bytes per second each rank's link carried, ``collective_bytes / seconds`` ("bus bandwidth",
    as nccl-tests reports): comparable across ranks and operations, and with the link's peak."""
    return collective_bytes(op, nbytes, world_size) / seconds if seconds > 0 else float("inf")
