"""Challenge 12, another way: the library's plan, then its remote moves dealt out in turn.

``minipar.adapt.moves.plan`` already meets goals 1 and 2 (local copies, only the missing
elements). Each of its remote elements is then handed to the holders of that element in turn,
a counter per holder set shared by all destinations and keys: with one set S the counter deals
M elements round-robin, ⌈M / |S|⌉ at most to each."""
import torch

from minipar.adapt import Move, Plan
from minipar.adapt.moves import plan


def balanced_plan(old, new, sizes):
    world, turn, moves = len(old), {}, []
    base = plan(old, new, sizes)
    where = {k: [({e: i for i, e in enumerate(h[k].tolist())} if k in h else {}) for h in old] for k in sizes}
    for mv in base.moves:
        if mv.src == mv.dst:
            moves.append(mv)
            continue
        picks = {}
        for e, d in zip(old[mv.src][mv.key][mv.src_pos].tolist(), mv.dst_pos.tolist()):
            held = tuple(r for r in range(world) if e in where[mv.key][r])
            r = held[turn.get(held, 0) % len(held)]
            turn[held] = turn.get(held, 0) + 1
            s, t = picks.setdefault(r, ([], []))
            s.append(where[mv.key][r][e])
            t.append(d)
        moves += [Move(r, mv.dst, mv.key, torch.tensor(s), torch.tensor(t)) for r, (s, t) in picks.items()]
    moves.sort(key=lambda mv: (mv.dst, mv.src))
    return Plan(world, moves)
