"""Challenge 12, one way: every missing element to its least-loaded holder, fewest holders first.

The local copies are the library's. The elements a destination lacks are placed in the order
of their number of holders (an element with one holder has no choice, so it goes first), each
to the holder that has sent the fewest elements so far (ties: the lowest rank). With one holder
set S this deals the M elements out ⌈M / |S|⌉ at most to each; with the nested holder sets that
layouts give (a shard's replicas inside a stage's ranks inside the world) it fills every set
level by level, which reaches max over T of ⌈M_T / |T|⌉."""
import torch

from minipar.adapt import Move, Plan


def balanced_plan(old, new, sizes):
    world, load, wanted, chosen = len(old), [0] * len(old), [], {}
    at = {key: [({e: i for i, e in enumerate(h[key].tolist())} if key in h else {}) for h in old] for key in sizes}
    for key in sizes:
        for q, h in enumerate(new):
            for i, e in enumerate(h[key].tolist() if key in h else []):
                if e in at[key][q]:
                    r = q                                    # a local copy
                    src, dst = chosen.setdefault((q, r, key), ([], []))
                    src.append(at[key][q][e])
                    dst.append(i)
                    continue
                held = [r for r in range(world) if e in at[key][r]]
                if not held:
                    raise ValueError(f"{key}: element {e} is held by no rank")
                wanted.append((len(held), q, key, i, e, held))
    for _, q, key, i, e, held in sorted(wanted, key=lambda w: w[0]):     # stable: fewest holders first
        r = min(held, key=lambda r: (load[r], r))
        load[r] += 1
        src, dst = chosen.setdefault((q, r, key), ([], []))
        src.append(at[key][r][e])
        dst.append(i)
    order = {key: n for n, key in enumerate(sizes)}
    moves = [Move(r, q, key, torch.tensor(s), torch.tensor(d)) for (q, r, key), (s, d) in chosen.items()]
    moves.sort(key=lambda mv: (mv.dst, mv.src, order[mv.key]))
    return Plan(world, moves)
