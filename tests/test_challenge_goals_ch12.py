"""ch12's goals can fail: an answer missing any one of them (a holder for every element, the
fewest bytes, the balance over the senders) is rejected with a message naming the goal, and
the library's ring-order plan (exercise 12 A) does not pass the challenge."""
import types

import pytest
import torch

from minipar.adapt import Move, Plan, plan
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch12_balanced_moves as ch12
from minipar.course.graded.alternatives import ch12_balanced_moves as alternative


def _fails(fn, case, match):
    with pytest.raises(GradeFailure, match=match):
        ch12.test_balanced_plan_meets_the_goals(types.SimpleNamespace(__name__="planted", balanced_plan=fn), case)


def test_a_valid_answer_passes():
    for case in ch12.CASES:
        ch12.test_balanced_plan_meets_the_goals(types.SimpleNamespace(balanced_plan=alternative.balanced_plan), case)


@pytest.mark.parametrize("case", list(ch12.CASES))
def test_the_library_plan_misses_the_balance(case):
    _fails(plan, case, r"goal 3: bytes sent per rank \[.*\], the largest \d+ B; the goal is at most")


def test_a_dropped_move_misses_goal_one():
    def drop_last(old, new, sizes):
        p = alternative.balanced_plan(old, new, sizes)
        return Plan(p.world_size, p.moves[:-1])
    _fails(drop_last, next(iter(ch12.CASES)), r"goal 1: rank 3's w after the plan is .*-1")


def test_sending_what_the_destination_holds_misses_goal_two():
    def resend(old, new, sizes):     # rank 0 keeps a(0, 1) but receives them from rank 1 instead
        p = alternative.balanced_plan(old, new, sizes)
        moves = [mv for mv in p.moves if mv.dst != 0]
        moves.append(Move(1, 0, "a", torch.tensor([9, 8]), torch.tensor([0, 1])))   # rank 1 holds a reversed
        return Plan(p.world_size, sorted(moves, key=lambda mv: (mv.dst, mv.src)))
    _fails(resend, "6 ranks, ranks 0-2 hold keys a (10) and b (7), ranks 3-5 need them",
           r"goal 2: the plan sends 196 B, the elements missing at their destination are 47 \(188 B\)")
