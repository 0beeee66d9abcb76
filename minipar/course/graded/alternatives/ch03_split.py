"""Challenge 03, another way: binary-search the pace. For a candidate limit c on a stage's
cost, cut greedily from the front, closing a stage before it would exceed c in cost or the
budget in memory; the smallest c that needs at most n stages (bisection on the integers
here) gives the split. Then enough micro-batches to meet the goal, not the most: the
smallest m whose simulated idle fraction is at most 0.40 (7 here)."""
from minipar import pipeline as pp

COST = [2, 6, 6, 6, 6, 6, 6, 6, 6, 10]
MEMORY = [8, 3, 3, 3, 3, 3, 3, 3, 3, 8]
BUDGET = 12


def _greedy(cost, memory, budget, limit):
    bounds, c, mem = [0], 0.0, 0.0
    for j, (x, y) in enumerate(zip(cost, memory)):
        if x > limit or y > budget:
            return None
        if c + x > limit or mem + y > budget:
            bounds.append(j)
            c, mem = 0.0, 0.0
        c, mem = c + x, mem + y
    return bounds + [len(cost)]


def _idle(cost, bounds, m):
    weights = [sum(cost[i:j]) for i, j in zip(bounds[:-1], bounds[1:])]
    ranks = pp.simulate(pp.make_schedule("gpipe", len(weights), m), f=1 / m, b=2 / m,
                        stage_weights=weights).ranks
    step = max(e["end"] for r in ranks for e in r)
    return 1 - sum(e["end"] - e["start"] for r in ranks for e in r) / (len(weights) * step)


def plan(cost, memory, budget, n):
    lo, hi = int(max(cost)), int(sum(cost)) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        b = _greedy(cost, memory, budget, mid)
        if b is not None and len(b) - 1 <= n:
            hi = mid
        else:
            lo = mid + 1
    bounds = _greedy(cost, memory, budget, lo)
    while len(bounds) - 1 < n:        # fewer stages than ranks: split the largest stage
        k = max(range(len(bounds) - 1), key=lambda s: bounds[s + 1] - bounds[s])
        bounds.insert(k + 1, (bounds[k] + bounds[k + 1]) // 2)
    m = next((m for m in range(1, 17) if _idle(cost, bounds, m) <= 0.40), 16)
    return bounds, m
