"""Challenge 04, one way: a list scheduler under a memory cap. Simulate the step in unit time
(F = B = W = 1). Whenever a rank is free it runs, by priority, a B whose gradient has arrived
(the previous stage waits for it), else, below the cap, the next F whose input has arrived,
else a pending W (which frees an activation); at the cap a pending W goes first, so the next
F can start as soon as its input arrives. The order each rank ran is its schedule."""
from functools import lru_cache

from minipar.pipeline import Action

CAP = 4     # micro-batches of activations a rank may hold


@lru_cache(maxsize=None)
def _orders(p: int, m: int) -> tuple:
    f_done, b_done = {}, {}               # (micro-batch, rank) -> time its F / B finishes
    next_f, held, free_at = [0] * p, [0] * p, [0] * p
    pending_w = [[] for _ in range(p)]
    orders = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in orders):
        for r in range(p):
            if free_at[r] > t:
                continue
            arrived = lambda done, key: done.get(key, t + 1) <= t     # noqa: E731
            ready_b = [i for i in range(m) if arrived(f_done, (i, r)) and (i, r) not in b_done
                       and (r == p - 1 or arrived(b_done, (i, r + 1)))]
            i = next_f[r]
            ready_f = i < m and held[r] < CAP and (r == 0 or arrived(f_done, (i, r - 1)))
            if held[r] >= CAP and pending_w[r]:
                held[r] -= 1
                orders[r].append(Action("W", pending_w[r].pop(0), r))
            elif ready_b:
                b_done[ready_b[0], r] = t + 1
                pending_w[r].append(ready_b[0])
                orders[r].append(Action("B", ready_b[0], r))
            elif ready_f:
                f_done[i, r] = t + 1
                next_f[r], held[r] = i + 1, held[r] + 1
                orders[r].append(Action("F", i, r))
            elif pending_w[r]:
                held[r] -= 1
                orders[r].append(Action("W", pending_w[r].pop(0), r))
            else:
                continue
            free_at[r] = t + 1
        t += 1
    return tuple(tuple(o) for o in orders)


def schedule(p: int, m: int, rank: int) -> list[Action]:
    return list(_orders(p, m)[rank])
