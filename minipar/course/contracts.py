"""Every core's contract beside the graded tests that observe it.

The clauses are the library's (``# Contract:`` blocks above the marked functions,
:func:`minipar.course.markers.clauses`); a graded test names the clauses it observes with
``@grading.observes("exNN.P.word", ...)``, kept on the test as ``__observes__``.
:func:`clause_table` puts the two side by side, :func:`stray_tags` lists a tag that names no
clause, and ``python -m minipar.course.exercise --clauses`` prints the table
(``tests/test_contract_clauses.py`` holds every clause to a test and every tag to a clause).
"""
from __future__ import annotations

import importlib

from .grading import observed
from .markers import clauses, exercises, stem


def _tags(exercise: str) -> dict[str, list[str]]:
    """:func:`~minipar.course.grading.observed` of ``exercise``'s graded module (imported)."""
    return observed(importlib.import_module(f"minipar.course.graded.test_{stem(exercise)}"))


def clause_table() -> dict[str, dict[str, list[str]]]:
    """``{exercise: {clause id: [graded tests observing it]}}`` over every core's contract
    (:func:`minipar.course.markers.clauses`), in the order of the contract."""
    out = {}
    for k in exercises():
        tags = _tags(k)
        out[k] = {c: sorted(tags.get(c, [])) for c in clauses(k)}
    return out


def stray_tags(exercise: str) -> dict[str, list[str]]:
    """The tags of ``exercise``'s graded tests that name no clause of its contract."""
    known = clauses(exercise)
    return {c: tests for c, tests in _tags(exercise).items() if c not in known}


def clause_table_text(table: dict | None = None) -> str:
    """:func:`clause_table` as Markdown: clause, its text (shortened), the tests."""
    table = clause_table() if table is None else table
    rows = ["| clause | says | observed by |", "|---|---|---|"]
    for k, cs in table.items():
        text = clauses(k)
        for c, tests in cs.items():
            says = text[c].text if len(text[c].text) <= 80 else text[c].text[:77] + "..."
            rows.append(f"| {c} | {says.replace('|', '/')} | {', '.join(tests) or '**none**'} |")
    return "\n".join(rows)
