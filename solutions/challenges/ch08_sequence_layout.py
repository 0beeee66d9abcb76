"""Challenge 08, one way: greedy by cost (longest processing time first, with quotas).

Hand out the positions from the most expensive (the last, p + 1 = T keys) to the cheapest;
each goes to the rank with the least work so far among those still below their token quota
(⌈T/cp⌉ for the first T mod cp ranks, ⌊T/cp⌋ for the others). Expensive tokens are spread
first and the many cheap ones even out what is left: Graham's LPT rule, whose imbalance
shrinks as the last items placed are the smallest."""


def layout(T: int, cp: int) -> list[list[int]]:
    quota = [T // cp + (r < T % cp) for r in range(cp)]
    out, work = [[] for _ in range(cp)], [0] * cp
    for p in reversed(range(T)):
        r = min((w, r) for r, w in enumerate(work) if len(out[r]) < quota[r])[1]
        out[r].append(p)
        work[r] += p + 1
    return [sorted(o) for o in out]
