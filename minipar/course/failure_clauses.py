"""The clauses a failed graded test names: ids from its message or its ``observes`` tags, texts
from the library's ``# Contract:`` blocks.

A graded test declares the clauses it observes (:func:`minipar.course.grading.observes`); when it
fails, :mod:`minipar.course.grade` prints ``clause exNN.P.word: <the clause's text>`` for the
clause its message names, or else for each clause it observes, and the hint line keeps the part
letter (``minipar.hint("ex10", "A")``). The texts are read from the source, where the contract
is written: a ``# Contract:`` comment block above a marked function, one clause per line
``# exNN.P.word: text``, continued on lines indented past the ``#``.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ID = re.compile(r"\b(?:ex|ch)\d\d\.(?:[A-Z]|\*)\.[a-z][a-z0-9_]*\b")
_CLAUSE = re.compile(r"^\s*#\s*((?:ex|ch)\d\d\.(?:[A-Z]|\*)\.[a-z][a-z0-9_]*):\s*(.*)$")
_CONTRACT = re.compile(r"^\s*#\s*Contract:\s*$")
_PACKAGE = Path(__file__).resolve().parents[1]          # minipar/


def _block_clauses(lines: list[str], start: int) -> dict[str, str]:
    """The clauses of the ``# Contract:`` block whose header is line ``start``."""
    out: dict[str, str] = {}
    current = None
    for ln in lines[start + 1:]:
        s = ln.strip()
        if not s.startswith("#"):
            break
        m = _CLAUSE.match(ln)
        if m:
            current = m[1]
            out[current] = m[2].strip()
        elif s[1:].startswith("  ") and current:        # a continuation of the clause above
            out[current] += " " + s[1:].strip()
        else:                                            # a given, or its continuation
            current = None
    return out


@lru_cache(maxsize=1)
def clause_texts() -> dict[str, str]:
    """``{clause id: text}`` over every ``# Contract:`` block in the library."""
    out: dict[str, str] = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if "Contract:" not in text:
            continue
        lines = text.splitlines()
        for i, ln in enumerate(lines):
            if _CONTRACT.match(ln):
                for k, v in _block_clauses(lines, i).items():
                    out.setdefault(k, " ".join(v.split()))
    return out


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
