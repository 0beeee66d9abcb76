"""Challenge 04, another way: let a greedy list scheduler find the order. Simulate the step
in unit time; whenever a rank is free it runs, by priority, a B whose gradient has arrived,
else the next F if it holds fewer than 4 activations and the input has arrived, else a
pending W (which frees an activation). The order it runs is the schedule."""
from functools import lru_cache

from minipar.pipeline import Action

CAP = 4


@lru_cache(maxsize=None)
def _orders(p: int, m: int) -> tuple:
    done_f, done_b = {}, {}               # (micro-batch, rank) -> time its F / B finishes
    next_f, held = [0] * p, [0] * p
    waiting_w = [[] for _ in range(p)]
    orders = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in orders):
        for r in range(p):
            ready_b = [i for i in range(m) if done_f.get((i, r), t + 1) <= t and (i, r) not in done_b
                       and (r == p - 1 or done_b.get((i, r + 1), t + 1) <= t)]
            i = next_f[r]
            ready_f = i < m and held[r] < CAP and (r == 0 or done_f.get((i, r - 1), t + 1) <= t)
            if ready_b:
                j = min(ready_b)
                done_b[j, r] = t + 1
                waiting_w[r].append(j)
                orders[r].append(Action("B", j, r))
            elif ready_f:
                done_f[i, r] = t + 1
                next_f[r] += 1
                held[r] += 1
                orders[r].append(Action("F", i, r))
            elif waiting_w[r]:
                held[r] -= 1
                orders[r].append(Action("W", waiting_w[r].pop(0), r))
        t += 1
    return tuple(tuple(o) for o in orders)


def schedule(p: int, m: int, rank: int) -> list[Action]:
    return list(_orders(p, m)[rank])
