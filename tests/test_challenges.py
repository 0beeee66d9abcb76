"""The challenges' goals can fail: textbook answers that miss them are rejected, with a message
that names what was measured against the goal."""
import types

import pytest

from minipar.course.grading import GradeFailure
from minipar.pipeline import schedules

from minipar.course.graded import test_ch03_split as ch03
from minipar.course.graded import test_ch04_schedule as ch04


def _module(**attrs):
    return types.SimpleNamespace(__name__="planted", **attrs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_ch04_textbook_schedules_miss_the_goal(name):
    fn = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}[name]
    planted = _module(schedule=fn)
    ch04.test_is_a_valid_schedule(planted)
    with pytest.raises(GradeFailure) as e:
        ch04.test_memory_goal(planted)
        ch04.test_bubble_goal(planted)
    assert "rank" in str(e.value) and "goal" in str(e.value)


def _capped_1f1b(p, m, r, split=False):
    """1F1B with its warm-up cut so that no rank holds more than 4 (W right after its B if split)."""
    warm = min(p - r - 1, m, 3)
    order = [schedules.Action("F", i, r) for i in range(warm)]
    for i in range(m - warm):
        order += [schedules.Action("F", warm + i, r), schedules.Action("B", i, r)]
    order += [schedules.Action("B", i, r) for i in range(m - warm, m)]
    return [a for x in order for a in ([x, schedules.Action("W", x.microbatch, r)] if split and x.op == "B" else [x])]


@pytest.mark.parametrize("split", [False, True])
def test_ch04_1f1b_cut_to_the_memory_misses_the_bubble_goal(split):
    planted = _module(schedule=lambda p, m, r: _capped_1f1b(p, m, r, split))
    ch04.test_is_a_valid_schedule(planted)
    ch04.test_memory_goal(planted)
    with pytest.raises(GradeFailure, match=r"bubble: rank \d idles \d\.\d+ of its busy time .* the goal is at most 0\.7"):
        ch04.test_bubble_goal(planted)


def test_ch04_deadlock_is_reported_with_the_table():
    planted = _module(schedule=lambda p, m, r: [schedules.Action(op, i, r) for op in "BF" for i in range(m)])
    with pytest.raises(GradeFailure, match="not a valid schedule"):
        ch04.test_is_a_valid_schedule(planted)


def test_ch03_goals_fail_for_the_naive_plans():
    cost, memory, budget = [2, 6, 6, 6, 6, 6, 6, 6, 6, 10], [8, 3, 3, 3, 3, 3, 3, 3, 3, 8], 12
    even = _module(COST=cost, MEMORY=memory, BUDGET=budget, plan=lambda c, mem, b, n: ([0, 3, 6, 8, 10], 16))
    with pytest.raises(GradeFailure, match=r"memory: rank 0 holds layers 0..2, 14 GiB"):
        ch03.test_memory_goal(even)
    one_batch = _module(COST=cost, MEMORY=memory, BUDGET=budget, plan=lambda c, mem, b, n: ([0, 2, 5, 8, 10], 1))
    ch03.test_memory_goal(one_batch)
    with pytest.raises(GradeFailure, match=r"idle: 0\.7"):
        ch03.test_idle_goal(one_batch)
    assert ch03.idle_fraction(cost, [0, 2, 5, 8, 10], 16) < ch03.IDLE_GOAL
