"""Challenge 04, one way: ZB-H1 written out (Qi et al. 2023). 1F1B's order with the backward
split into B (input gradient, on the critical path) and W (weight gradient, movable): rank r
defers its Ws by r micro-batches in the steady state, so that in the cool-down, where 1F1B
idles, it has Ws to run after each B. Peak memory stays 1F1B's p micro-batches."""
from minipar.pipeline import Action


def schedule(p: int, m: int, rank: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    out = [Action("F", i, rank) for i in range(warmup)]
    deferred = []
    for i in range(m - warmup):
        out += [Action("F", warmup + i, rank), Action("B", i, rank)]
        deferred.append(i)
        if len(deferred) > rank:
            out.append(Action("W", deferred.pop(0), rank))
    for j in range(m - warmup, m):
        deferred.append(j)
        out += [Action("B", j, rank), Action("W", deferred.pop(0), rank)]
    return out + [Action("W", j, rank) for j in deferred]
