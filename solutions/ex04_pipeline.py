"""Exercise 04, solved: balanced partitioning and the 1F1B schedule.

See ``exercises/ex04_pipeline.py`` for the statement and ``minipar/pipeline/partition.py``
and ``minipar/pipeline/schedules.py`` for the library's versions. This solution finds the
partition by binary search on the answer (the library uses dynamic programming).
"""
from minipar.pipeline.schedules import Action


def _stages_needed(costs, limit):
    """Greedy: how many stages if each takes layers while its cost stays <= limit."""
    n, acc = 1, 0.0
    for c in costs:
        if acc + c > limit:
            n, acc = n + 1, 0.0
        acc += c
    return n


def partition(costs: list[float], p: int) -> list[int]:
    """Stage boundaries ``[0, b_1, ..., L]`` (stage s = layers ``b_s : b_{s+1}``, none empty)
    minimising the cost of the most expensive stage."""
    L = len(costs)
    if not 1 <= p <= L:
        raise ValueError(f"cannot cut {L} layers into {p} stages: more stages than layers")
    # the optimum is the cost of some contiguous run of layers: search over those values
    sums = sorted({sum(costs[i:j]) for i in range(L) for j in range(i + 1, L + 1)})
    lo, hi = 0, len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if max(costs) <= sums[mid] and _stages_needed(costs, sums[mid]) <= p:
            hi = mid
        else:
            lo = mid + 1
    limit = sums[lo]
    # cut greedily from the end, leaving at least one layer for each remaining stage
    bounds, acc = [L], 0.0
    for i in range(L - 1, -1, -1):
        stages_left = p - len(bounds)          # stages still to open before this one
        if acc + costs[i] > limit or i < stages_left:
            bounds.append(i + 1)
            acc = 0.0
        acc += costs[i]
    bounds.append(0)
    return bounds[::-1]


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """1F1B on ``rank``: warm-up ``min(p - rank - 1, m)`` forwards, steady F,B pairs, cool-down Bs."""
    warmup = min(p - rank - 1, m)
    order = [Action("F", i, rank) for i in range(warmup)]
    for i in range(m - warmup):               # steady state: one forward, one backward
        order.append(Action("F", warmup + i, rank))
        order.append(Action("B", i, rank))
    for i in range(m - warmup, m):            # cool-down
        order.append(Action("B", i, rank))
    return order
