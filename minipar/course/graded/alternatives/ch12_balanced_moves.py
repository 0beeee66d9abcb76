"""Challenge 12, another way: the library's plan, then its remote elements shared out by holder set.

``minipar.adapt.moves.plan`` already meets goals 1 and 2 (local copies, only the missing
elements). Its remote elements are grouped by the set of ranks that hold them; each group's
count is split among its holders: first all to one of them, then, while a rank at the top load
can pass work down a chain of holders (r gives a unit of a group it sends to another holder r' of
that group, r' to the next, ...) to a rank at least 2 below it, half the gap travels along the
chain. When no such chain is left, the ranks the top ones reach hold only groups inside that set T
and all of them are within 1 of the top, so the top is ⌈M_T / |T|⌉: the least possible."""
import torch

from minipar.adapt import Move, Plan
from minipar.adapt.moves import plan


def _chain(share, load, world):
    """A chain [(r, group, r'), ...] from a rank at the top load to one at least 2 below, or None."""
    top = max(load)
    came = {r: None for r in range(world) if load[r] == top}
    frontier = list(came)
    while frontier:
        step = []
        for r in frontier:
            for g, s in share.items():
                if s[r] > 0:
                    for r2 in g:
                        if r2 in came:
                            continue
                        came[r2] = (r, g)
                        if load[r2] <= top - 2:
                            out, at = [], r2
                            while came[at] is not None:
                                r0, g0 = came[at]
                                out.append((r0, g0, at))
                                at = r0
                            return out[::-1]
                        step.append(r2)
        frontier = step
    return None


def balanced_plan(old, new, sizes):
    world = len(old)
    where = {k: [({e: i for i, e in enumerate(h[k].tolist())} if k in h else {}) for h in old] for k in sizes}
    moves, units = [], {}                  # units: holder set -> [(dst, key, dst position, element)]
    for mv in plan(old, new, sizes).moves:
        if mv.src == mv.dst:
            moves.append(mv)
            continue
        for e, d in zip(old[mv.src][mv.key][mv.src_pos].tolist(), mv.dst_pos.tolist()):
            held = tuple(r for r in range(world) if e in where[mv.key][r])
            units.setdefault(held, []).append((mv.dst, mv.key, d, e))
    share = {g: {r: (len(u) if r == g[0] else 0) for r in g} for g, u in units.items()}
    load = [sum(s.get(r, 0) for s in share.values()) for r in range(world)]
    for s in share.values():
        for r in range(world):
            s.setdefault(r, 0)
    while (chain := _chain(share, load, world)) is not None:
        first, last = chain[0][0], chain[-1][2]
        amount = min(min(share[g][r] for r, g, _ in chain), (load[first] - load[last]) // 2)
        for r, g, r2 in chain:
            share[g][r] -= amount
            share[g][r2] += amount
        load[first] -= amount
        load[last] += amount
    picks = {}
    for g, u in units.items():
        at = 0
        for r in g:
            for dst, key, d, e in u[at:at + share[g][r]]:
                s, t = picks.setdefault((r, dst, key), ([], []))
                s.append(where[key][r][e])
                t.append(d)
            at += share[g][r]
    moves += [Move(r, dst, key, torch.tensor(s), torch.tensor(t)) for (r, dst, key), (s, t) in picks.items()]
    order = {k: n for n, k in enumerate(sizes)}
    moves.sort(key=lambda mv: (mv.dst, mv.src, order[mv.key]))
    return Plan(world, moves)
