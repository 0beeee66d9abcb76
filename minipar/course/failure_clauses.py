"""The clauses a failed graded test names: ids from its message or its ``observes`` tags, texts
from the library's ``# Contract:`` blocks.

A graded test declares the clauses it observes (:func:`minipar.course.grading.observes`); when it
fails, :mod:`minipar.course.grade` prints ``clause exNN.P.word: <the clause's text>`` for the
clause its message names, or else, when the learner's code raised, for each clause it observes of
the part whose function raised, or else for each clause it observes; the hint line keeps the part
letter (``minipar.hint("ex10", "A")``). The texts are read from the source, where the contract
is written (``# Contract:`` blocks above the marked functions), through the one reader of them,
:func:`minipar.course.markers.clauses`.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

from .markers import ROOT, clauses, definitions, exercises, pieces

ID = re.compile(r"\b(?:ex|ch)\d\d\.(?:[A-Z]|\*)\.[a-z][a-z0-9_]*\b")


@lru_cache(maxsize=1)
def clause_texts() -> dict[str, str]:
    """``{clause id: text}`` of every exercise's contract, as :func:`minipar.course.markers.clauses`
    reads them from the library's ``# Contract:`` blocks."""
    return {c.id: c.text for k in exercises() for c in clauses(k).values()}


def named(error: str, observes) -> list[str]:
    """The clauses a failure breaks: the ones its message names (when it names any); for a crash
    in the learner's file, the test's ``observes`` tags of the part whose code raised
    (:func:`crashed_in`; all of them when it observes none of that part); else every ``observes``
    tag; in order, each once."""
    in_message = list(dict.fromkeys(ID.findall(error or "")))
    if in_message:
        return in_message
    observes = list(dict.fromkeys(observes or ()))
    raised = crashed_in(error)
    return [c for c in observes if c.split(".")[1] == raised] or observes


# where a failure's message shows the learner's code that raised: "rank 1: exercises/ex09_x.py:140  code"
PLACE = re.compile(r"(?:^|: )(\S+?\.py):(\d+)  ")


def crashed_in(error: str) -> str | None:
    """The part whose code raised, when a failure is a crash in the learner's file: the innermost
    marked function (or method) of the exercise around the first place the message shows
    (``exercises/exNN_topic.py:LINE  code``, as the grader writes it); None for any other failure,
    a helper of the learner's own outside every marked function, or a function of several parts."""
    m = PLACE.search(error or "")
    if m is None or not re.match(r"(?:ex|ch)\d\d", Path(m[1]).name):
        return None
    path = Path(m[1]) if Path(m[1]).is_absolute() else ROOT / m[1]
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    exercise, line = Path(m[1]).name[:4], int(m[2])
    parts = {p.qualname: {r.part for r in p.regions if r.exercise == exercise} for p in pieces(exercise)}
    around = [q for q, node, _ in definitions(tree.body) if node.lineno <= line <= node.end_lineno]
    for qualname in sorted(around, key=len, reverse=True):          # innermost first
        if len(parts.get(qualname, ())) == 1:
            return next(iter(parts[qualname]))
    return None


def lines(ids) -> list[str]:
    """``clause exNN.P.word: text`` for each id (the id alone when its text is not found)."""
    texts = clause_texts()
    return [f"clause {c}: {texts[c]}" if c in texts else f"clause {c}" for c in ids]


def part(ids) -> str | None:
    """The part letter the clauses belong to (the first that names one; ``*`` names none)."""
    for c in ids:
        p = c.split(".")[1]
        if p != "*":
            return p
    return None


def failed_part(error: str, observes) -> str | None:
    """The part a failure's hint is for: that of the clauses its message names; when it names
    none of a part, that of the code that raised (a crash: :func:`crashed_in`) when the test observes
    that part; else (a hang, only ``*`` clauses) the test's part only if all it observes is one part,
    else no part
    (a test of parts A and C that hangs in C must not point at A)."""
    named_part = part(list(dict.fromkeys(ID.findall(error or ""))))
    if named_part is not None:
        return named_part
    parts = {c.split(".")[1] for c in observes or ()} - {"*"}
    raised = crashed_in(error)       # a crash in a part the test does not observe (part C's function,
    if raised in parts:              # called by the part D it tests) tells less than the test's part
        return raised
    return parts.pop() if len(parts) == 1 else None
