"""The clauses a failed graded test names: ids from its message or its ``observes`` tags, texts
from the library's ``# Contract:`` blocks.

A graded test declares the clauses it observes (:func:`minipar.course.grading.observes`); when it
fails, :mod:`minipar.course.grade` prints ``clause exNN.P.word: <the clause's text>`` for the
clause its message names, or else for each clause it observes, and the hint line keeps the part
letter (``minipar.hint("ex10", "A")``). The texts are read from the source, where the contract
is written (``# Contract:`` blocks above the marked functions), through the one reader of them,
:func:`minipar.course.markers.clauses`.
"""
from __future__ import annotations

import re
from functools import lru_cache

from .markers import clauses, exercises

ID = re.compile(r"\b(?:ex|ch)\d\d\.(?:[A-Z]|\*)\.[a-z][a-z0-9_]*\b")


@lru_cache(maxsize=1)
def clause_texts() -> dict[str, str]:
    """``{clause id: text}`` of every exercise's contract, as :func:`minipar.course.markers.clauses`
    reads them from the library's ``# Contract:`` blocks."""
    return {c.id: c.text for k in exercises() for c in clauses(k).values()}


def named(error: str, observes) -> list[str]:
    """The clauses a failure breaks: the ones its message names (when it names any), else the
    test's ``observes`` tags, in order, each once."""
    in_message = list(dict.fromkeys(ID.findall(error or "")))
    return in_message or list(dict.fromkeys(observes or ()))


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
    none of a part (a hang, a crash, only ``*`` clauses), the test's part only if all it observes is one part, else no part
    (a test of parts A and C that hangs in C must not point at A)."""
    named_part = part(list(dict.fromkeys(ID.findall(error or ""))))
    if named_part is not None:
        return named_part
    parts = {c.split(".")[1] for c in observes or ()} - {"*"}
    return parts.pop() if len(parts) == 1 else None
