"""ch12's goals can fail: an answer missing any one of them (a holder for every element, the
fewest bytes, the balance over the senders) is rejected with a message naming the goal, on the
hand-made cases and on the switches between real layouts (4 and 6 ranks, sizes the world does not
divide, ZeRO-3 on either side); the library's ring-order plan (exercise 12 A) does not pass the
challenge, and goal 3's bound is exact: both answers reach it, and where every element has one
holder any valid plan meets it."""
import types

import pytest
import torch

from minipar.adapt import Move, Plan, plan
from minipar.course.challenge import load
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch12_balanced_moves as ch12
from minipar.course.graded.alternatives import ch12_balanced_moves as alternative

LAYOUTS = list(ch12.LAYOUT_CASES)
FORCED = "4 ranks, dp=4,zero=3 -> dp=2,pp=2,zero=1"        # every element sent has a single holder
ZERO3 = "6 ranks, dp=3,tp=2 -> dp=3,pp=2,zero=3"


def _grade(fn, case):
    ch12.test_balanced_plan_meets_the_goals(types.SimpleNamespace(__name__="planted", balanced_plan=fn), case)


def _fails(fn, case, match):
    with pytest.raises(GradeFailure, match=match):
        _grade(fn, case)


def test_both_answers_pass_and_reach_the_bound_exactly():
    solution = load(ch12.CHALLENGE, "solution").balanced_plan
    for case in list(ch12.CASES) + LAYOUTS:
        old, new, sizes = ch12.case(case)
        least = ch12.least_largest_send(ch12.holder_sets(old, new, sizes), len(old))[0]
        for fn in (solution, alternative.balanced_plan):
            _grade(fn, case)
            assert max(fn(old, new, sizes).sent(4)) == 4 * least, (case, fn.__module__)


@pytest.mark.parametrize("case", list(ch12.CASES) + [c for c in LAYOUTS if c != FORCED])
def test_the_library_plan_misses_the_balance(case):
    _fails(plan, case, r"goal 3: bytes sent per rank \[.*\], the largest \d+ B; the goal is at most "
                       r"⌈M_T / \|T\|⌉ × 4 = ⌈\d+ / \d⌉ × 4 = \d+ B, T = ranks \[")


def test_with_one_holder_per_element_every_valid_plan_is_balanced():
    old, new, sizes = ch12.case(FORCED)
    assert set(map(lambda s: bin(s).count("1"), ch12.holder_sets(old, new, sizes))) == {1}
    _grade(plan, FORCED)


def _drop_last(old, new, sizes):
    p = alternative.balanced_plan(old, new, sizes)
    return Plan(p.world_size, p.moves[:-1])


@pytest.mark.parametrize("case", [next(iter(ch12.CASES)), "6 ranks, pp=3,tp=2 -> dp=6"])
def test_a_dropped_move_misses_goal_one(case):
    _fails(_drop_last, case, r"goal 1: rank 5's \S+ after the plan is .*-1" if "dp=6" in case
           else r"goal 1: rank 3's w after the plan is .*-1")


def test_a_source_that_does_not_hold_the_element_misses_goal_one():
    def wrong_source(old, new, sizes):      # one remote move's elements read at shifted positions
        p = alternative.balanced_plan(old, new, sizes)
        i = next(i for i, mv in enumerate(p.moves) if mv.src != mv.dst and len(mv.src_pos) > 1)
        mv = p.moves[i]
        shifted = Move(mv.src, mv.dst, mv.key, mv.src_pos.roll(1), mv.dst_pos)
        return Plan(p.world_size, p.moves[:i] + [shifted] + p.moves[i + 1:])
    _fails(wrong_source, ZERO3, r"goal 1: rank \d's \S+ after the plan is")


def _resend_what_is_held(old, new, sizes):
    """Every local copy whose elements another rank also holds is received from that rank instead."""
    p = alternative.balanced_plan(old, new, sizes)
    moves = []
    for mv in p.moves:
        if mv.src != mv.dst:
            moves.append(mv)
            continue
        elems = old[mv.src][mv.key][mv.src_pos]
        other = next((r for r in range(len(old)) if r != mv.src and mv.key in old[r]
                      and bool(torch.isin(elems, old[r][mv.key]).all())), None)
        if other is None:
            moves.append(mv)
            continue
        where = {e: i for i, e in enumerate(old[other][mv.key].tolist())}
        moves.append(Move(other, mv.dst, mv.key, torch.tensor([where[e] for e in elems.tolist()]), mv.dst_pos))
    return Plan(p.world_size, sorted(moves, key=lambda mv: (mv.dst, mv.src)))


def test_sending_what_the_destination_holds_misses_goal_two():
    def resend(old, new, sizes):     # rank 0 keeps a(0, 1) but receives them from rank 1 instead
        p = alternative.balanced_plan(old, new, sizes)
        moves = [mv for mv in p.moves if mv.dst != 0]
        moves.append(Move(1, 0, "a", torch.tensor([9, 8]), torch.tensor([0, 1])))   # rank 1 holds a reversed
        return Plan(p.world_size, sorted(moves, key=lambda mv: (mv.dst, mv.src)))
    _fails(resend, "6 ranks, ranks 0-2 hold keys a (10) and b (7), ranks 3-5 need them",
           r"goal 2: the plan sends 196 B, the elements missing at their destination are 47 \(188 B\)")
    old, new, sizes = ch12.case("4 ranks, pp=2,tp=2 -> dp=4")
    missing = sum(ch12.holder_sets(old, new, sizes).values())
    _fails(_resend_what_is_held, "4 ranks, pp=2,tp=2 -> dp=4",
           rf"goal 2: the plan sends \d+ B, the elements missing at their destination are {missing} \({4 * missing} B\)")


def test_balancing_in_key_order_alone_misses_goal_three():
    """Least-loaded, but each key's elements placed before the next key's, whatever their holders:
    a (held by ranks 0 and 1) is dealt 4 and 4, then b (rank 0 only) lands on top of rank 0's 4."""
    def key_order(old, new, sizes):
        world, load, moves = len(old), [0] * len(old), []
        for key in sizes:
            at = [({e: i for i, e in enumerate(h[key].tolist())} if key in h else {}) for h in old]
            for q, h in enumerate(new):
                picks = {}
                for i, e in enumerate(h[key].tolist() if key in h else []):
                    r = q if e in at[q] else min((r for r in range(world) if e in at[r]), key=lambda r: (load[r], r))
                    load[r] += r != q
                    picks.setdefault(r, ([], []))[0].append(at[r][e])
                    picks[r][1].append(i)
                moves += [Move(r, q, key, torch.tensor(s), torch.tensor(d)) for r, (s, d) in picks.items()]
        return Plan(world, sorted(moves, key=lambda mv: (mv.dst, mv.src)))
    _fails(key_order, "3 ranks, rank 0 holds a (8) and b (4), rank 1 only a, rank 2 needs both (two holder sets)",
           r"goal 3: bytes sent per rank \[32, 16, 0\], the largest 32 B; the goal is at most ⌈M_T / \|T\|⌉ × 4 = "
           r"⌈12 / 2⌉ × 4 = 24 B, T = ranks \[0, 1\]")
    for case in LAYOUTS:                   # on the layouts' nested holder sets key order happens to do
        _grade(key_order, case)
