"""Challenge 12, one way: every missing element to its least-loaded holder.

The local copies are the library's; for an element its destination lacks, of the ranks that
hold it the one that has sent the fewest elements so far sends it (ties: the lowest rank). With
one holder set S this deals the M elements out ⌈M / |S|⌉ at most to each."""
import torch

from minipar.adapt import Move, Plan


def balanced_plan(old, new, sizes):
    world, load, moves = len(old), [0] * len(old), []
    for key in sizes:
        at = [({e: i for i, e in enumerate(h[key].tolist())} if key in h else {}) for h in old]
        for q, h in enumerate(new):
            if key not in h:
                continue
            chosen = {}                                      # src -> ([src positions], [dst positions])
            for i, e in enumerate(h[key].tolist()):
                if e in at[q]:
                    r = q
                else:
                    held = [r for r in range(world) if e in at[r]]
                    if not held:
                        raise ValueError(f"{key}: element {e} is held by no rank")
                    r = min(held, key=lambda r: (load[r], r))
                    load[r] += 1
                src, dst = chosen.setdefault(r, ([], []))
                src.append(at[r][e])
                dst.append(i)
            moves += [Move(r, q, key, torch.tensor(s), torch.tensor(d)) for r, (s, d) in chosen.items()]
    moves.sort(key=lambda mv: (mv.dst, mv.src))
    return Plan(world, moves)
