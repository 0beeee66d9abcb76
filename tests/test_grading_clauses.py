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
