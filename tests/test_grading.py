"""The grader itself: stubs score zero quickly and cleanly, a correct file scores 100%."""
import time

import pytest

from minipar import grade


@pytest.fixture(scope="module")
def stub_reports():
    """Every exercise's graded tests on the generated stubs, in one grading run."""
    t = time.perf_counter()
    reports = {r.exercise.split("_")[0]: r for r in grade.grade_many(grade.exercises(), "exercise", verbose=False)}
    return reports, time.perf_counter() - t


@pytest.mark.parametrize("exercise", grade.exercises())
def test_exercise_stubs_score_zero_without_hanging(exercise, stub_reports):
    """Every graded test of a generated stub fails, within the stub's own NotImplementedError
    (in the driver or in a rank), and nothing hangs."""
    reports, seconds = stub_reports
    assert seconds < 60 * len(reports), f"grading the stubs took {seconds:.0f} s"
    report = reports[exercise]
    assert report.tests, "no graded tests were collected"
    assert report.score == 0.0
    assert all(r["outcome"] == "failed" for r in report.tests), [r["outcome"] for r in report.tests]
    label = f"Exercise {exercise[2:]}"
    assert all("NotImplementedError" in r["error"] and label in r["error"] for r in report.tests), \
        [r["error"][:200] for r in report.tests]


def test_the_solution_scores_full_marks_through_the_grader(capsys):
    report = grade.grade("ex01", target="solution")
    assert report.score == 1.0 and len(report.tests) >= 5
    assert f"score: {len(report.tests)}/{len(report.tests)} (100%)" in capsys.readouterr().out
