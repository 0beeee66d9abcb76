"""Challenge 12: the same bytes, spread over the senders.

``balanced_plan(old, new, sizes)`` returns a ``minipar.adapt.Plan`` (of ``minipar.adapt.Move``)
from the ranks' ``old`` holdings to their ``new`` ones, as ``minipar.adapt.moves.plan`` does,
graded on switches where a few ranks hold everything and the others need it. Goals: (1) every
element of a new holding gets one source that holds it (checked by carrying each element's
global index); (2) the fewest bytes: exactly the elements missing at their destination are
sent, 4 bytes each, never one the destination holds; (3) balance: when every missing element
is held by the same set S of ranks, the largest per-rank send is at most ⌈M / |S|⌉ elements,
M the elements sent in all. The library's ring order misses goal 3 on every case (one holder
sends to every rank after it). Grade it with ``python -m minipar.grade ch12``;
``minipar.hint("ch12")`` gives a nudge, then the idea, then the method.
"""
import math

import pytest
import torch

from minipar.adapt.moves import Plan
from minipar.course.grading import GradeFailure

CHALLENGE = "ch12_balanced_moves"
HINTS = {
    "": ("Goal 3 is about who sends, not what is sent: the same elements must travel, but the "
         "holders can take turns.",
         "Keep the local copies as the library does; for the elements a rank lacks, choose among "
         "their holders the one that has sent the least so far (or deal them out in turn), and "
         "count every rank's load across all destinations and keys.",
         "load = [0] * world; for each key, each destination q, each element e that q lacks: r = the "
         "holder of e with the smallest load[r] (ties: the lowest rank); load[r] += 1; group the "
         "choices into one Move(r, q, key, src_pos, dst_pos) per source; sort moves by (dst, src)."),
}


def _idx(*xs):
    return torch.tensor(xs, dtype=torch.long)


def _all(n):
    return torch.arange(n)


CASES = {  # name: (old holdings, new holdings, sizes)
    "4 ranks, ranks 0 and 1 hold all 12, ranks 2 and 3 need them": (
        [{"w": _all(12)}, {"w": _all(12).flip(0)}, {}, {}], [{}, {}, {"w": _all(12)}, {"w": _all(12)}], {"w": 12}),
    "6 ranks, ranks 0-2 hold keys a (10) and b (7), ranks 3-5 need them": (
        [{"a": _all(10), "b": _all(7)}, {"a": _all(10).flip(0), "b": _all(7)}, {"a": _all(10), "b": _all(7).flip(0)},
         {}, {}, {}],
        [{"a": _idx(0, 1)}, {}, {}, {"a": _all(10), "b": _all(7)}, {"a": _all(10).flip(0), "b": _all(7)},
         {"a": _all(10), "b": _idx(6, 0, 3)}], {"a": 10, "b": 7}),
    "3 ranks, ranks 0 and 1 hold all 7, rank 2 needs them (an odd count)": (
        [{"w": _all(7)}, {"w": _all(7)}, {}], [{"w": _idx(0, 1)}, {}, {"w": _all(7).flip(0)}], {"w": 7}),
}


def check(p, old, new, sizes, name):
    """The three goals on one case; raises GradeFailure naming the first one missed."""
    world = len(old)
    if not isinstance(p, Plan) or p.world_size != world:
        raise GradeFailure(f"{name}: balanced_plan returned {type(p).__name__} (world {getattr(p, 'world_size', '?')}), "
                           f"not a Plan of {world} ranks")
    got = [{k: torch.full((len(i),), -1) for k, i in h.items()} for h in new]
    for mv in p.moves:
        if mv.key not in old[mv.src] or mv.key not in got[mv.dst] or len(mv.src_pos) != len(mv.dst_pos):
            raise GradeFailure(f"{name}: goal 1: a move of {mv.key} from rank {mv.src} to rank {mv.dst} that one of "
                               f"them does not hold (or of unequal lengths)")
        if bool((got[mv.dst][mv.key][mv.dst_pos] != -1).any()):
            raise GradeFailure(f"{name}: goal 1: an element of rank {mv.dst}'s {mv.key} given two sources")
        got[mv.dst][mv.key][mv.dst_pos] = old[mv.src][mv.key][mv.src_pos]
    for q, h in enumerate(new):
        for k, i in h.items():
            if got[q][k].tolist() != i.tolist():
                raise GradeFailure(f"{name}: goal 1: rank {q}'s {k} after the plan is {got[q][k].tolist()} "
                                   f"(-1: no source), the new holding is {i.tolist()}")
    missing, holders = 0, set()
    for q, h in enumerate(new):
        for k, i in h.items():
            for e in i.tolist():
                if not (k in old[q] and e in old[q][k].tolist()):
                    missing += 1
                    holders |= {r for r in range(world) if k in old[r] and e in old[r][k].tolist()}
    if p.bytes(4) != 4 * missing:
        raise GradeFailure(f"{name}: goal 2: the plan sends {p.bytes(4)} B, the elements missing at their "
                           f"destination are {missing} ({4 * missing} B)")
    bound = 4 * math.ceil(missing / len(holders))
    sent = p.sent(4)
    if max(sent) > bound:
        raise GradeFailure(f"{name}: goal 3: bytes sent per rank {sent}, the largest {max(sent)} B; the goal is at "
                           f"most ⌈{missing} / {len(holders)} senders⌉ × 4 = {bound} B")


@pytest.mark.parametrize("case", list(CASES))
def test_balanced_plan_meets_the_goals(challenge, case):
    """Every element one holder, the fewest bytes, the largest send at most ⌈M / |S|⌉ elements."""
    old, new, sizes = CASES[case]
    check(challenge.balanced_plan(old, new, sizes), old, new, sizes, case)
