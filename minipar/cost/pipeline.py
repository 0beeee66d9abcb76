"""Cost of pipeline schedules: the bubble and the activations each rank stashes.

With p stages of equal cost, m micro-batches, forward time F and backward B + W (input
and weight gradients), a step ideally takes m(F+B+W) per rank; the **bubble** is the
idle time relative to that ideal (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", §2.2):

    GPipe (AFAB), 1F1B      (p-1)/m
    interleaved 1F1B        (p-1)/(v·m)                   (v virtual stages per rank)
    ZB-H1                   ((p-1)(F+B) - min(m-1, p-1)·W) / (m(F+B+W))
                            = (p-1)(F+B-W)/(m(F+B+W)), = (p-1)/(3m) for F=B=W, when m ≥ p
                            (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3)

Peak activations stashed on rank r, in micro-batches of one stage (a virtual stage
holds 1/v of the rank's layers, so divide by v for the rank's share):

    GPipe          m                 (every forward before any backward)
    1F1B           min(p - r, m)
    interleaved    min(2(p - r - 1) + (v-1)p + 1, m·v), or m·v when m = p
    ZB-H1          min(p, m)          (Ws deferred on later ranks, never above 1F1B's peak)
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # the one list: the pipeline and the planner read it


def _name(schedule) -> str:
    name = getattr(schedule, "name", schedule)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    return name


def bubble_fraction(schedule, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                    w: float = 1.0) -> float:
    """Idle time over ideal time for ``schedule`` (a name or a Schedule) on p equal stages,
    m micro-batches, v virtual stages; ``f``, ``b``, ``w`` only matter for ZB-H1."""
    name = _name(schedule)
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    if name == "interleaved":
        return (p - 1) / (v * m)
    if name == "zb-h1":
        return max((p - 1) * (f + b) - min(m - 1, p - 1) * w, 0.0) / (m * (f + b + w))
    return (p - 1) / m


def peak_activations(schedule, p: int, m: int, rank: int, v: int = 1) -> int:
    """Most micro-batch activations (of one stage) rank ``rank`` holds at once."""
    name = _name(schedule)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not in 0..{p - 1}")
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "zb-h1":
        return min(p, m)
    if m == p:
        return m * v
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)


def pipeline_time(p: int, m: int, t_stage: float, v: int = 1) -> float:
    """Step time of GPipe/1F1B (v=1) or interleaved 1F1B when a stage's forward+backward of
    one micro-batch takes ``t_stage``: ``(m + (p-1)/v) · t_stage``."""
    return (m + (p - 1) / v) * t_stage
