"""ch04 cannot be passed by calling the library's answer: a learner's file that takes ZB-H1 (or
any generator) from ``minipar.pipeline`` is refused before grading, naming the line; and ZB-H1
copied out (the library's own zero-bubble schedule) meets the bubble goal but not the memory
goal (it holds p micro-batches, 5 at p = 5). The goals' other planted failures (GPipe, 1F1B,
1F1B cut to 4 held, a deadlock) are in ``tests/test_challenges.py``."""
import types

import pytest

from minipar import pipeline as pp
from minipar.course import challenge
from minipar.course.challenge import EXERCISES_ENV
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch04_schedule as ch04

STUB = (challenge.directory("solution") / "ch04_schedule.py").read_text()
TAKES_THE_ANSWER = {
    "from minipar.pipeline import make_schedule\n":
        "    return [a for a in make_schedule('zb-h1', p, m).actions[rank] if a.op in 'FBW']\n",
    "from minipar.pipeline import zb_h1\n": "    return zb_h1(p, m, rank)\n",
    "import minipar.pipeline.schedules as s\n": "    return s.zb_h1(p, m, rank)\n",
    "import minipar.pipeline as pp\n": "    return pp.zb_h1(p, m, rank)\n",
}


@pytest.mark.parametrize("line", list(TAKES_THE_ANSWER), ids=range(len(TAKES_THE_ANSWER)))
def test_the_librarys_schedule_is_refused(tmp_path, monkeypatch, line):
    (tmp_path / "challenges").mkdir()
    path = tmp_path / "challenges" / "ch04_schedule.py"
    path.write_text(f'"""Mine."""\nfrom minipar.pipeline import Action\n{line}\n\n'
                    f"def schedule(p, m, rank):\n{TAKES_THE_ANSWER[line]}")
    monkeypatch.setenv(EXERCISES_ENV, str(tmp_path))
    with pytest.raises(GradeFailure, match=r"ch04_schedule\.py:[37]  .*\n  this challenge is graded without"):
        challenge.load("ch04_schedule", "exercise")


def test_a_zb_h1_copy_fails_the_memory_goal_and_the_solution_loads(tmp_path, monkeypatch):
    copied = types.SimpleNamespace(__name__="planted", schedule=pp.zb_h1)
    ch04.test_is_a_valid_schedule(copied)
    ch04.test_bubble_goal(copied)
    with pytest.raises(GradeFailure, match=r"memory: p = 5, m = 5: rank 0 holds 5 micro-batches at once"):
        ch04.test_memory_goal(copied)
    (tmp_path / "challenges").mkdir()
    (tmp_path / "challenges" / "ch04_schedule.py").write_text(STUB)
    monkeypatch.setenv(EXERCISES_ENV, str(tmp_path))
    mine = challenge.load("ch04_schedule", "exercise")       # Action from minipar.pipeline is fine
    for test in (ch04.test_is_a_valid_schedule, ch04.test_memory_goal, ch04.test_bubble_goal):
        test(mine)


def test_only_compute_actions_are_taken():
    planted = types.SimpleNamespace(__name__="planted", schedule=lambda p, m, r: pp.add_comms(pp.gpipe(p, m, r), p, p))
    with pytest.raises(GradeFailure, match=r"rank 0: the order holds \[.*SEND_F.*\], expected only compute actions"):
        ch04.test_is_a_valid_schedule(planted)
