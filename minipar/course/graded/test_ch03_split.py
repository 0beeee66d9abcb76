"""Challenge 03: cut a model over 4 ranks so that they idle less, within their memory.

Write ``plan(cost, memory, budget, n) -> (bounds, m)`` in ``exercises/challenges/ch03_split.py``:
contiguous, non-empty stages for n = 4 ranks and a number of micro-batches m <= 16. GPipe's
schedule is simulated (``pipeline.simulate``, a stage's forward costs its layers' cost / m per
micro-batch, the backward twice that). Goals: every rank's layers within the memory budget,
and an idle fraction of the step, 1 - Σ busy / (n · step), of at most 0.40. The library's
``pipeline.partition`` balances cost alone and misses the memory goal here. Grade it with
``python -m minipar.grade ch03``; stuck? ``minipar.hint("ch03")``.
"""
from minipar import pipeline as pp
from minipar.course.grading import fail_if, observes

CHALLENGE = "ch03_split"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNodjDsOwjAQRK8yJTQcgIZLIFEv8SRexdkNXocot8+nnDd67706WlYbApOMRBUbA5oKn1iMv0UKo'
        'snAwI1/1s2NWEVboPd6qEQUXxntDrF0gV5LuUaqogbvLzrrzKLGBz5Zu4wzlPzonufEyeuG75IGNnRu0U73t'
        'QMS5TnZ',
        'sealed:eNotjUEOwjAMBL+yR5CAEwckTjzFTdwmIomR7YL6+yai152d3VeVtsATI6xu+CUxBn9ZN5jTwphzj'
        'wef1riwX+D0ZkjjoxvEvGQ2P/rZEBLTZySn7imDdAhlw+P+f3GB63Z+jt2GKp3XHFSuE3mXDZZEvaPxO+dSQ'
        'C0iKuV22wFPwD/C',
        'sealed:eNpNT8sKwjAQ/JU5Vgil9YWgHv0K8RDr2i5mE8luUf/eWBE8zGWY5yGOQtkbgY2ypRS07pKcOXrjF'
        'LXKPvZUtQ5tM3NYFNyI7rAhKeHBNkD8E2q+JwhJyi/s9mjnDsKRhYvKBvoTdUltO3FXNuPYoxsNx8aheFYOm'
        '0/VCYPXr0En5of1FoKSv0aV8pSi4kMgtcI/plHKMoby6AK+hPJLP4OaetnM6jfoj0u1',
    ),
}
N = 4
IDLE_GOAL = 0.40
MAX_MICROBATCHES = 16


def idle_fraction(cost, bounds, m):
    """1 - (busy time of all ranks) / (n · step) in GPipe's simulated step."""
    weights = [sum(cost[i:j]) for i, j in zip(bounds[:-1], bounds[1:])]
    ranks = pp.simulate(pp.make_schedule("gpipe", len(weights), m), f=1 / m, b=2 / m,
                        stage_weights=weights).ranks
    step = max(e["end"] for r in ranks for e in r) - min(e["start"] for r in ranks for e in r)
    return 1 - sum(e["end"] - e["start"] for r in ranks for e in r) / (len(weights) * step)


def _plan(challenge):
    c = challenge
    bounds, m = c.plan(list(c.COST), list(c.MEMORY), c.BUDGET, N)
    bounds = [int(b) for b in bounds]
    L = len(c.COST)
    fail_if(len(bounds) != N + 1 or bounds[0] != 0 or bounds[-1] != L,
             f"bounds {bounds}: expected {N + 1} boundaries from 0 to {L} ({N} stages)")
    empty = [s for s in range(N) if bounds[s + 1] <= bounds[s]]
    fail_if(bool(empty), f"bounds {bounds}: stage {empty[0] if empty else ''} holds no layer "
             f"(boundaries {bounds[empty[0]] if empty else ''} and {bounds[empty[0] + 1] if empty else ''}); "
             "expected boundaries that increase strictly")
    fail_if(not (isinstance(m, int) and 1 <= m <= MAX_MICROBATCHES),
             f"m = {m!r}: expected an int from 1 to {MAX_MICROBATCHES} micro-batches")
    return bounds, m


@observes('ch03.*.valid')
def test_split_is_valid(challenge):
    """The plan is 5 boundaries from 0 to 10, no stage empty, and 1 <= m <= 16."""
    _plan(challenge)


@observes('ch03.*.memory')
def test_memory_goal(challenge):
    """Every rank's layers fit in the memory budget."""
    bounds, _ = _plan(challenge)
    c = challenge
    mem = [sum(c.MEMORY[i:j]) for i, j in zip(bounds[:-1], bounds[1:])]
    worst = max(range(N), key=lambda s: mem[s])
    fail_if(mem[worst] > c.BUDGET, f"memory: rank {worst} holds layers {bounds[worst]}..{bounds[worst + 1] - 1}, "
             f"{mem[worst]} GiB; the budget is {c.BUDGET} GiB per rank (per rank: {mem})")


@observes('ch03.*.idle')
def test_idle_goal(challenge):
    """The simulated step's idle fraction is at most 0.40 (layer-count stages, one batch: 0.75)."""
    bounds, m = _plan(challenge)
    c = challenge
    idle = idle_fraction(c.COST, bounds, m)
    stage = [sum(c.COST[i:j]) for i, j in zip(bounds[:-1], bounds[1:])]
    fail_if(idle > IDLE_GOAL + 1e-9,
             f"idle: {idle:.3f} of the step with bounds {bounds} and m = {m}; the goal is at most "
             f"{IDLE_GOAL}. Stage costs {stage} (the mean: {sum(c.COST) / N:g})")
