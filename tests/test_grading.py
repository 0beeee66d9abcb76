"""The grader itself: stubs score zero quickly and cleanly, a correct file scores 100%."""
import time

import pytest

from minipar import grade


@pytest.mark.parametrize("exercise", grade.exercises())
def test_exercise_stubs_score_zero_without_hanging(exercise):
    t = time.perf_counter()
    report = grade.grade(exercise, target="exercise", verbose=False)
    assert time.perf_counter() - t < 240
    assert report.tests, "no graded tests were collected"
    assert report.score == 0.0
    assert all(r["outcome"] == "failed" for r in report.tests), [r["outcome"] for r in report.tests]
    assert all("NotImplementedError" in r["error"] or "Exercise" in r["error"] for r in report.tests), \
        [r["error"][:200] for r in report.tests]


def test_the_solution_scores_full_marks_through_the_grader(capsys):
    report = grade.grade("ex01", target="solution")
    assert report.score == 1.0 and len(report.tests) >= 5
    assert "score: 5/5 (100%)" in capsys.readouterr().out
