"""Challenge 08, another way: zigzag chunks, then local search.

Start from the zigzag of 2·cp nearly equal chunks (rank r: chunks r and 2cp-1-r), then
repeatedly swap one position of the busiest rank with one of the least busy rank, choosing
the swap that brings the two closest to their mean, until no swap helps. Swaps keep every
rank's token count, so memory stays balanced; each accepted swap lowers the busiest rank's
work or the number of ranks at the maximum."""
import torch


def layout(T: int, cp: int) -> list[list[int]]:
    chunks = [c.tolist() for c in torch.arange(T).tensor_split(2 * cp)]
    ranks = [chunks[r] + chunks[2 * cp - 1 - r] for r in range(cp)]
    work = [sum(p + 1 for p in r) for r in ranks]
    for _ in range(10 * T):
        hi, lo = max(range(cp), key=work.__getitem__), min(range(cp), key=work.__getitem__)
        gap = work[hi] - work[lo]
        best = None                                   # the swap (a from hi, b from lo) closest to gap / 2
        for i, a in enumerate(ranks[hi]):
            for j, b in enumerate(ranks[lo]):
                d = a - b
                if 0 < d < gap and (best is None or abs(gap - 2 * d) < abs(gap - 2 * best[0])):
                    best = (d, i, j)
        if best is None:
            break
        d, i, j = best
        ranks[hi][i], ranks[lo][j] = ranks[lo][j], ranks[hi][i]
        work[hi] -= d
        work[lo] += d
    return ranks
