"""Planted wrong answers: an exercise's solution with a few lines changed, run as a learner's
file, in the driver and in every rank it launches. The graded tests must fail on it, naming the
clause of the contract the change breaks (issue: a grader that lets no wrong answer through)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

import minipar
from minipar.course.exercise import EXERCISES_ENV, environ
from minipar.course.grading import GradeFailure
from minipar.course.markers import ROOT, stem
from minipar.runtime.launch import RankError


def source(exercise: str, *edits: tuple[str, str]) -> str:
    """solutions/exNN_topic.py with each ``(old, new)`` applied; ``old`` must occur exactly once,
    so a plant cannot silently stop applying when the solution changes."""
    text = (ROOT / "solutions" / f"{stem(exercise)}.py").read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{stem(exercise)}: {old!r} occurs {text.count(old)} times"
        text = text.replace(old, new)
    return text


@contextmanager
def planted(exercise: str, directory: Path, *edits: tuple[str, str]):
    """Activate the solution of ``exercise`` with ``edits`` as the learner's file (written to
    ``directory``), so the graded tests called inside run it, in the driver and in the ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{stem(exercise)}.py").write_text(source(exercise, *edits))
    with environ(EXERCISES_ENV, str(directory)), minipar.exercise(exercise, "exercise"):
        yield


def fails(test, *args, match: str, **kwargs) -> str:
    """Run graded ``test("exercise", *args)`` and expect it to fail as the grader would report
    it (a ``GradeFailure``, or a rank's error) with a message matching ``match`` (a regular
    expression); returns the message."""
    with pytest.raises((GradeFailure, RankError), match=match) as e:
        test("exercise", *args, **kwargs)
    return str(e.value)


def names_its_clause(message: str, test, clause: str) -> None:
    """The grader names ``clause`` for this failure of ``test``, and, when the test observes several
    clauses, not every one of them (the check that failed names its own: ``grading.breaks``), unless
    the code crashed (no check failed, so the grader cannot tell which clause); the hint it points to
    (:func:`minipar.course.failure_clauses.failed_part`) is for the clause's part."""
    from minipar.course.failure_clauses import named
    observes = getattr(test, "__observes__", ())
    got = named(message, observes)
    crashed = "the call raised" in message or "died" in message     # no check failed: the grader cannot tell which
    assert clause in got, f"{test.__name__}: the failure names {got}, not {clause}:\n{message}"
    assert crashed or len(observes) == 1 or set(got) != set(observes), \
        f"{test.__name__}: the failure names every clause the test observes, {got}:\n{message}"
    from minipar.course.failure_clauses import failed_part
    part = clause.split(".")[1]
    hint = failed_part(message, observes)
    assert crashed or part == "*" or hint == part, \
        f"{test.__name__}: the failure's hint is for part {hint}, its clause {clause} is of part {part}:\n{message}"


def contract_tests(exercise: str, graded, plants: dict, elsewhere=()):
    """The two tests every ``tests/test_planted_exNN.py`` runs, for ``graded`` (the graded module)
    and ``plants`` (``{clause: (edits, test, match)}`` or ``(edits, test, args, match)``):

    * every plant names a clause of the exercise's contract (the library's ``# Contract:``
      blocks), and every clause a graded test observes is planted here, or in
      ``tests/test_planted_wrong_answers.py`` (``elsewhere``);
    * each plant, run as the learner's file, fails a test tagged as observing its clause
      (``grading.observes``), with a message matching ``match``, and the grader names that clause
      (and not every clause of a test that observes several: :func:`names_its_clause`).

    ``test_every_clause_is_planted, test_planted_answer_fails = contract_tests(...)`` at module level."""
    def test_every_clause_is_planted():
        from minipar.course.grading import observed
        from minipar.course.markers import clauses
        assert set(plants) <= set(clauses(exercise)), set(plants) - set(clauses(exercise))
        assert set(observed(graded)) - set(elsewhere) == set(plants), \
            set(observed(graded)) - set(elsewhere) ^ set(plants)

    @pytest.mark.parametrize("clause", list(plants))
    def test_planted_answer_fails(clause, tmp_path):
        edits, test, *args, match = plants[clause]
        from minipar.course.grading import observed
        assert test.__name__ in observed(graded).get(clause, ()), (clause, test.__name__)
        with planted(exercise, tmp_path, *edits):
            message = fails(test, *(args[0] if args else ()), match=match)
        names_its_clause(message, test, clause)
    return test_every_clause_is_planted, test_planted_answer_fails


def more_tests(exercise: str, graded, more: list, name_clause: bool = False):
    """``test_more_wrong_answers_fail = more_tests(...)`` at module level: for each further wrong
    answer ``(clause, edits, graded test, match)`` of ``more``, the test observes the clause, and the
    answer, run as the learner's file, fails it with a message matching ``match``; with
    ``name_clause``, the grader names that clause too (:func:`names_its_clause`)."""
    @pytest.mark.parametrize("k", range(len(more)))
    def test_more_wrong_answers_fail(k, tmp_path):
        from minipar.course.grading import observed
        clause, edits, test, match = more[k]
        assert test.__name__ in observed(graded).get(clause, ()), (clause, test.__name__)
        with planted(exercise, tmp_path, *edits):
            message = fails(test, match=match)
        if name_clause:
            names_its_clause(message, test, clause)
    return test_more_wrong_answers_fail
