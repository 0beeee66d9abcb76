"""A failure names the clause it breaks, and its hint line keeps the part.

The grader prints, under a failed test, ``clause exNN.P.word: <text>`` for the clause its message
names, or else for each clause the test observes (its ``grading.observes`` tags), with the text
read from the library's ``# Contract:`` block; the ``stuck?`` line asks for that part's hint.
"""
from __future__ import annotations

import re

from minipar.course import exercise_files, failure_clauses, grade, markers
from minipar.course.grade import Report


def _failed(error: str, observes) -> dict:
    return {"name": "test_x", "doc": "The reducer over two steps.", "observes": list(observes),
            "outcome": "failed", "error": error, "file": "test_ex02_data_parallel.py"}


def test_a_contract_block_is_read_clause_by_clause():
    """The texts are the contracts' own, one per clause id, a clause continued on the next line
    joined into one (ex12.A.bytes spans two lines) and a given no clause."""
    texts = failure_clauses.clause_texts()
    for k in markers.exercises():
        for c in markers.clauses(k).values():
            assert texts[c.id] == c.text
    assert texts["ex12.A.bytes"] == ("the plan's bytes (``Plan.sent``, the library's) are then exactly the "
                                     "elements missing at their destination, each at its key's itemsize.")
    assert not any(k.startswith("Given") or not failure_clauses.ID.fullmatch(k) for k in texts)


def test_a_failure_prints_its_observed_clauses_and_the_part_to_ask_about(monkeypatch):
    monkeypatch.setattr(failure_clauses, "clause_texts", lambda: {"ex02.C.reset": "the state is reset"})
    text = str(Report("ex02_data_parallel", "exercise",
                      [_failed("loss at step 1: expected 2.5, got 2.7", ["ex02.C.reset", "ex02.*.recorded"])]))
    assert "clause ex02.C.reset: the state is reset" in text
    assert "clause ex02.*.recorded" in text                  # no text found: the id alone
    assert 'stuck? minipar.hint("ex02", "C")' in text


def test_a_message_that_names_a_clause_names_only_that_one(monkeypatch):
    monkeypatch.setattr(failure_clauses, "clause_texts", lambda: {})
    text = str(Report("ex10_planning", "exercise",
                      [_failed("one layer's bytes (ex10.A.flash): expected 3, got 4", ["ex10.A.cp_scores",
                                                                                       "ex10.A.flash"])]))
    assert re.findall(r"clause (\S+)", text) == ["ex10.A.flash"]
    assert 'minipar.hint("ex10", "A")' in text


def test_a_clause_of_every_part_asks_for_the_part_the_test_observes(monkeypatch):
    monkeypatch.setattr(failure_clauses, "clause_texts", lambda: {})
    text = str(Report("ex06_zero", "exercise",
                      [_failed("group of 2 (ex06.*.group): expected shape (4,), got shape (2,)",
                               ["ex06.A.mean", "ex06.*.group"])]))
    assert re.findall(r"clause (\S+)", text) == ["ex06.*.group"]
    assert 'minipar.hint("ex06", "A")' in text


def test_a_passed_test_prints_no_clause():
    t = dict(_failed("", ["ex02.C.reset"]), outcome="passed")
    assert "clause" not in str(Report("ex02_data_parallel", "exercise", [t]))


def test_every_graded_clause_tag_has_its_text_when_the_library_has_contracts():
    """Once the library carries ``# Contract:`` blocks, the texts found are keyed by valid ids."""
    texts = failure_clauses.clause_texts()
    assert all(failure_clauses.ID.fullmatch(k) and v for k, v in texts.items())


def test_grading_the_stub_names_the_clauses_and_parts(tmp_path, monkeypatch):
    """End to end on ex10's stub (pure Python, a few seconds): every failure prints a clause line
    and asks for its part's hint."""
    monkeypatch.setenv("MINIPAR_HOME", str(tmp_path))
    exercise_files.write_stubs(tmp_path / "stubs")      # fresh stubs: the learner's file may be solved
    [report] = grade.grade_many(["ex10"], "exercise", verbose=False, challenge=False,
                                select="test_stage_layers or test_layer_activations_with_cp",
                                exercises_dir=tmp_path / "stubs")
    text = str(report)
    assert report.tests and all(t["outcome"] == "failed" for t in report.tests)
    assert all(t["observes"] for t in report.tests)
    assert text.count("\n        clause ex10.") >= len(report.tests)
    assert 'minipar.hint("ex10", "A")' in text and 'minipar.hint("ex10", "C")' in text
    assert 'minipar.hint("ex10")' not in text


def test_a_hang_in_a_test_of_two_parts_asks_for_no_part(monkeypatch):
    """A test observing parts A and C that hangs (a message naming no clause) does not point at
    part A: the hang may be C's; a failure naming a clause of C asks for C."""
    monkeypatch.setattr(failure_clauses, "clause_texts", lambda: {})
    observes = ["ex09.A.exchange", "ex09.C.order", "ex09.C.backward", "ex09.*.recorded"]
    hang = str(Report("ex09_expert_parallel", "exercise",
                      [_failed("the ranks did not finish within 120 s (a collective waits for a peer)", observes)]))
    assert 'stuck? minipar.hint("ex09")' in hang and 'minipar.hint("ex09", "A")' not in hang
    named = str(Report("ex09_expert_parallel", "exercise",
                       [_failed("rank 0: the input's gradient\n  breaks ex09.C.backward", observes)]))
    assert 'minipar.hint("ex09", "C")' in named


def _line_of(path, text: str) -> int:
    lines = path.read_text().splitlines()
    hits = [i + 1 for i, ln in enumerate(lines) if text in ln]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def test_a_crash_names_the_clauses_of_the_part_whose_code_raised(tmp_path):
    """A crash names no clause in its message; the grader then names the clauses the test observes of
    the part whose function raised (the innermost marked function around the place it shows), and the
    hint is for that part. A helper of the learner's own, outside every marked function, tells nothing:
    every clause the test observes."""
    learner = tmp_path / "ex09_expert_parallel.py"
    learner.write_text((markers.ROOT / "solutions" / "ex09_expert_parallel.py").read_text()
                       + "\n\ndef my_helper(x):\n    return x.foo\n")
    observes = ["ex09.A.exchange", "ex09.C.order", "ex09.C.empty", "ex09.*.group"]
    in_exchange = _line_of(learner, "out = x.new_empty(sum(recv)")
    error = f"rank 1: {learner}:{in_exchange}  out = x.new_empty(sum(recv), *x.shape[1:])  TypeError: boom"
    assert failure_clauses.crashed_in(error) == "C"
    assert failure_clauses.named(error, observes) == ["ex09.C.order", "ex09.C.empty"]
    assert failure_clauses.failed_part(error, observes) == "C"
    in_forward = _line_of(learner, "arrived = all_to_all(")
    assert failure_clauses.crashed_in(f"{learner}:{in_forward}  arrived = ...  ValueError: boom") == "D"
    assert failure_clauses.named(f"{learner}:{in_forward}  x  ValueError: boom", observes) == observes  # no D clause
    in_helper = _line_of(learner, "return x.foo")
    helper = f"rank 0: {learner}:{in_helper}  return x.foo  AttributeError: boom"
    assert failure_clauses.crashed_in(helper) is None
    assert failure_clauses.named(helper, observes) == observes
    assert failure_clauses.failed_part(helper, observes) is None
    assert failure_clauses.crashed_in("loss at step 1: expected 2.5, got 2.7") is None


def test_a_planted_crash_names_its_part_in_the_grade_report(tmp_path):
    """End to end: ex09's exchange_counts raising inside the ranks crashes test_exchanges_on_ranks,
    which observes clauses of parts A and C (and two of every part): the grader's message shows the
    learner's line, and names A's clause alone, with A's hint."""
    import pytest
    from minipar.course._grade_plugin import explain
    from minipar.course.graded import test_ex09_expert_parallel as g
    from minipar.runtime.launch import RankError
    from tests.planted import planted
    with planted("ex09", tmp_path, ("    out = counts.new_empty(ep * counts.numel())",
                                    "    out = counts.new_empty(ep * counts.numel(), bogus=1)")):
        with pytest.raises(RankError) as e:
            g.test_exchanges_on_ranks("exercise")
        message = explain(e.value)                         # as the grade report shows it
    assert "ex09_expert_parallel.py:" in message and "bogus=1" in message, message
    observes = g.test_exchanges_on_ranks.__observes__
    assert failure_clauses.named(message, observes) == ["ex09.A.exchange"], message
    assert failure_clauses.failed_part(message, observes) == "A"


def test_a_crash_in_a_part_the_test_does_not_observe_asks_for_the_tests_part():
    """A crash inside part C's exchange, called by the part D that the test observes (its only part):
    the clauses named are D's, and so is the hint, not C's."""
    learner = markers.ROOT / "solutions" / "ex09_expert_parallel.py"
    line = _line_of(learner, "out = x.new_empty(sum(recv)")
    error = f"rank 0: solutions/ex09_expert_parallel.py:{line}  out = ...  RuntimeError: Split sizes doesn't match"
    observes = ["ex09.D.exact", "ex09.D.grads"]
    assert failure_clauses.crashed_in(error) == "C"
    assert failure_clauses.named(error, observes) == observes
    assert failure_clauses.failed_part(error, observes) == "D"
