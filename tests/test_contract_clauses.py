"""Every clause of every core's contract is observed by a graded test, and every tag is a clause.

A core's contract lives beside its code, in the ``# Contract:`` blocks above the library's
marked functions (:func:`minipar.course.markers.clauses`: ids ``exNN.P.word``); a graded test
names the clauses it observes with ``@grading.observes("exNN.P.word", ...)``. Here, per core:

* every clause of the contract is observed by at least one graded test of the core's module;
* every tag of the core's graded tests names a clause of its contract (no stale or misspelled id);
* the table clause -> tests (``python -m minipar.course.exercise --clauses`` prints it) is
  what this file checks; run with ``-s`` to see it.
"""
import pytest

from minipar.course import contracts, markers

CORES = markers.exercises()


@pytest.fixture(scope="module")
def table():
    return contracts.clause_table()


@pytest.mark.parametrize("k", CORES)
def test_every_clause_is_observed_by_a_graded_test(k, table):
    unobserved = [c for c, tests in table[k].items() if not tests]
    assert unobserved == [], f"{k}: clauses no graded test observes: {unobserved}"


@pytest.mark.parametrize("k", CORES)
def test_every_tag_names_a_clause(k):
    stray = contracts.stray_tags(k)
    assert stray == {}, f"{k}: tags that name no clause of the contract: {stray}"


def test_the_table_is_printed(table, capsys):
    text = contracts.clause_table_text(table)
    print(text)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ex")]
    assert len(rows) == sum(len(v) for v in table.values()) > 0
