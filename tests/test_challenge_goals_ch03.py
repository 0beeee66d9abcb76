"""ch03's goals can fail: a plan missing any one of them (a valid split, the memory budget, the
idle fraction) is rejected with a message naming what was measured against the goal, and the
library's own answer (``pipeline.partition``, balanced by cost alone) does not pass."""
import types

import pytest

from minipar import pipeline as pp
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch03_split as ch03
from minipar.course.graded.alternatives import ch03_split as alternative

COST, MEMORY, BUDGET = alternative.COST, alternative.MEMORY, alternative.BUDGET


def _module(plan):
    return types.SimpleNamespace(__name__="planted", COST=COST, MEMORY=MEMORY, BUDGET=BUDGET, plan=plan)


def test_a_valid_plan_passes():
    m = _module(alternative.plan)
    for test in (ch03.test_split_is_valid, ch03.test_memory_goal, ch03.test_idle_goal):
        test(m)


@pytest.mark.parametrize("bounds, m, match", [
    ([0, 2, 2, 8, 10], 16, r"bounds \[0, 2, 2, 8, 10\]: stage 1 holds no layer"),
    ([0, 2, 5, 10], 16, r"expected 5 boundaries from 0 to 10"),
    ([0, 2, 5, 8, 10], 17, r"m = 17: expected an int from 1 to 16"),
])
def test_an_invalid_plan_is_refused(bounds, m, match):
    with pytest.raises(GradeFailure, match=match):
        ch03.test_split_is_valid(_module(lambda c, mem, b, n: (bounds, m)))


def test_over_the_budget_misses_the_memory_goal():
    with pytest.raises(GradeFailure, match=r"memory: rank 0 holds layers 0\.\.2, 14 GiB; the budget is 12"):
        ch03.test_memory_goal(_module(lambda c, mem, b, n: ([0, 3, 6, 8, 10], 16)))


def test_one_batch_misses_the_idle_goal():
    m = _module(lambda c, mem, b, n: ([0, 2, 5, 8, 10], 1))
    ch03.test_memory_goal(m)
    with pytest.raises(GradeFailure, match=r"idle: 0\.7\d\d of the step .* the goal is at most 0\.4"):
        ch03.test_idle_goal(m)


def test_the_librarys_partition_does_not_pass():
    """pipeline.partition minimises the costliest stage alone: its cut puts 14 GiB on rank 0."""
    bounds = pp.partition(COST, 4)
    assert bounds == [0, 3, 5, 8, 10]
    m = _module(lambda c, mem, b, n: (pp.partition(c, n), 16))
    ch03.test_split_is_valid(m)
    ch03.test_idle_goal(m)
    with pytest.raises(GradeFailure, match=r"memory: rank 0 holds layers 0\.\.2, 14 GiB"):
        ch03.test_memory_goal(m)
