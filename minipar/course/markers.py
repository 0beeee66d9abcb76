"""The library's marked regions: where a learner's code goes, read from the source.

A region sits inside a function or method, between ``# >>> exNN [PART]`` and
``# <<< exNN [PART]`` comments, with optional ``# Hint:`` lines right after the opening one
(see :mod:`minipar.course.exercise`). :func:`pieces` lists the functions and methods holding
regions; :func:`stem` names an exercise by its graded test file in :data:`GRADED`
(``minipar/course/graded/``, shipped with the package). Both the activation
(:mod:`minipar.course.exercise`) and the generator of the exercise and solution files
(:mod:`minipar.course.exercise_files`) read the markers from here.

A marked function's **contract** is a comment block right above its ``def`` (above its
decorators), at the def's indentation::

    # Contract:
    # ex02.A.average: after the call every trainable parameter's ``.grad`` holds ...
    #     a clause may run on over indented lines
    # ex02.*.recorded: a clause of every part of ex02
    # Given: what the code may rely on or use (no id, nothing to grade)
    def allreduce_gradients(params, group=None, all_reduce_fn=None) -> None:
        # the library's own docstring follows: how the code works

Each clause has a stable id ``exNN.P.word`` (``P`` a part letter, or ``*`` for every part;
``word`` names the clause); a clause says what must hold (inputs and outputs, shapes, dtypes,
groups, what is sent, what is held at the peak, what is reset), never the steps. The library
keeps its explanatory docstring; the generated exercise and solution files show the contract
in its place (:func:`contract_docstring`), so the one source of a clause sits beside the code
it describes. :func:`clauses` lists an exercise's clauses; the graded tests name the ones they
observe."""
from __future__ import annotations

import ast
import re
import textwrap
import tokenize
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]   # minipar/
ROOT = PACKAGE.parent                           # the repository, or site-packages once installed
GRADED = PACKAGE / "course" / "graded"          # the graded tests, inside the package
_MARK = re.compile(r"#\s*(>>>|<<<)\s*(ex\d+)(?:\s+(\w+))?\s*$")
_HINT = re.compile(r"\s*# Hint:")
_CONTRACT = re.compile(r"\s*# Contract:\s*$")
_GIVEN = re.compile(r"\s*#\s*Given:\s*(.*)$")
_CLAUSE = re.compile(r"\s*#\s*((?:ex|ch)\d+\.(?:[A-Z]|\*)\.[a-z][a-z0-9_]*):\s*(.*)$")
CLAUSE_ID = re.compile(r"(?:ex|ch)\d+\.(?:[A-Z]|\*)\.[a-z][a-z0-9_]*")


@dataclass
class Region:
    """Lines ``start`` (the ``# >>>`` marker) to ``end`` (``# <<<``) of a library file, 0-based."""
    exercise: str                 # "ex02"
    part: str                     # "B", or "" for a one-part exercise
    start: int
    end: int
    indent: str
    hints: list[str]

    def label(self) -> str:
        return f"Exercise {self.exercise[2:]}{' ' + self.part if self.part else ''}"


@dataclass(frozen=True)
class Clause:
    """One clause of a contract: ``ex02.C.group`` and its text (line breaks joined)."""
    id: str
    text: str

    @property
    def exercise(self) -> str:
        return self.id.split(".")[0]

    @property
    def part(self) -> str:
        return self.id.split(".")[1]


@dataclass
class Piece:
    """A library function or method (``qualname`` in ``module``) holding marked regions."""
    module: str
    path: Path
    qualname: str
    first: int                    # first line of the def (its decorators included), 0-based
    last: int                     # last line of the def, 0-based
    classes: list                 # the ast.ClassDef nodes around a method, outermost first
    regions: list[Region] = field(default_factory=list)
    contract: list[Clause] = field(default_factory=list)   # the block above the def
    doc: tuple[int, int] | None = None   # the docstring's first and last line, 0-based
    body_indent: str = ""

    def clauses(self, exercise: str) -> list[Clause]:
        """The clauses of this piece's contract that belong to ``exercise`` ("ex02")."""
        return [c for c in self.contract if c.id and c.exercise == exercise]

    def given(self) -> list[str]:
        """The contract's ``# Given:`` paragraphs: what the code may rely on and use (no id:
        nothing to grade)."""
        return [c.text for c in self.contract if not c.id]


def _regions(path: Path, lines: list[str]) -> list[Region]:
    with tokenize.open(path) as f:
        marks = [(t.start[0] - 1, m) for t in tokenize.generate_tokens(f.readline)
                 if t.type == tokenize.COMMENT and (m := _MARK.match(t.string))]
    out, open_ = [], None
    for i, m in marks:
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        if m[1] == ">>>":
            if open_:
                raise SyntaxError(f"{where}: marker opened inside {open_.exercise} {open_.part}")
            hints = [h.rstrip() for h in takewhile(_HINT.match, lines[i + 1:])]
            open_ = Region(m[2], m[3] or "", i, -1, re.match(r"\s*", lines[i])[0], hints)
        else:
            if not open_ or (open_.exercise, open_.part) != (m[2], m[3] or ""):
                raise SyntaxError(f"{where}: closing marker without its opening one")
            open_.end = i
            out.append(open_)
            open_ = None
    if open_:
        raise SyntaxError(f"{path.relative_to(ROOT)}:{open_.start + 1}: marker never closed")
    return out


def _contract(path: Path, lines: list[str], first: int) -> list[Clause]:
    """The ``# Contract:`` comment block right above line ``first`` (a def or its first
    decorator), as clauses; [] where there is none."""
    i = first
    while i > 0 and lines[i - 1].strip().startswith("#"):
        i -= 1
    block = lines[i:first]
    starts = [j for j, ln in enumerate(block) if _CONTRACT.match(ln)]
    if not starts:
        return []
    out: list[list[str]] = []
    for j, ln in enumerate(block[starts[-1] + 1:], start=i + starts[-1] + 1):
        m, g = _CLAUSE.match(ln), _GIVEN.match(ln)
        if m:
            out.append([m[1], m[2].strip()])
        elif g:
            out.append(["", g[1].strip()])
        elif out and ln.strip().startswith("#") and ln.strip()[1:].startswith("  "):
            out[-1][1] += " " + ln.strip()[1:].strip()
        else:
            raise SyntaxError(f"{path.relative_to(ROOT)}:{j + 1}: a contract line is a clause "
                              "('# exNN.P.word: text'), a given ('# Given: text') or its indented "
                              "continuation")
    if not out:
        raise SyntaxError(f"{path.relative_to(ROOT)}:{i + starts[-1] + 1}: an empty contract")
    return [Clause(c, " ".join(text.split())) for c, text in out]   # id "": a given


def definitions(body, classes=()):
    """(qualname, def node, enclosing classes) for module functions and (nested) class methods."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield ".".join([c.name for c in classes] + [node.name]), node, list(classes)
        elif isinstance(node, ast.ClassDef):
            yield from definitions(node.body, (*classes, node))


def _pieces_of(path: Path) -> list[Piece]:
    text = path.read_text()
    if ">>>" not in text:
        return []
    lines = text.splitlines()
    regions = _regions(path, lines)
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    pieces = []
    for qualname, node, classes in definitions(ast.parse(text).body):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        # the opening marker sits in the body; the closing one may follow its last statement
        inside = [r for r in regions if node.lineno - 1 < r.start < node.end_lineno - 1]
        if inside:
            last = max([node.end_lineno - 1] + [r.end for r in inside])
            head = node.body[0]
            doc = (head.lineno - 1, head.end_lineno - 1) if isinstance(head, ast.Expr) and \
                isinstance(head.value, ast.Constant) and isinstance(head.value.value, str) else None
            indent = re.match(r"\s*", lines[head.lineno - 1])[0]
            pieces.append(Piece(module, path, qualname, first, last, classes, inside,
                                _contract(path, lines, first), doc, indent))
    for r in regions:
        if not any(r in p.regions for p in pieces):
            raise SyntaxError(f"{path.relative_to(ROOT)}:{r.start + 1}: a marked region must sit "
                              "inside the body of a function or method")
    return pieces


_cache: dict = {}


def pieces(exercise: str | None = None) -> list[Piece]:
    """Every marked piece of the library (of ``exercise``, e.g. "ex02", if given), in the
    order of the exercise's parts, then module, then line."""
    files = sorted(p for p in PACKAGE.rglob("*.py")
                   if p != Path(__file__).resolve() and GRADED not in p.parents)   # the library only
    key = tuple((p, p.stat().st_mtime_ns) for p in files)
    if _cache.get("key") != key:
        _cache.update(key=key, pieces=[pc for p in files for pc in _pieces_of(p)])
    out = [p for p in _cache["pieces"] if exercise is None or any(r.exercise == exercise for r in p.regions)]
    return sorted(out, key=lambda p: (min(r.part for r in p.regions), p.module, p.first))


def exercises() -> list[str]:
    """Short names of the exercises that have markers in the library: ["ex01", ...]."""
    return sorted({r.exercise for p in pieces() for r in p.regions})


def clauses(exercise: str) -> dict[str, Clause]:
    """``{id: Clause}``: every clause of ``exercise``'s contract ("ex02"), in the order of its
    pieces; a ``ValueError`` where one id is given twice or names a part the exercise lacks."""
    k = key(exercise)
    out: dict[str, Clause] = {}
    marked = pieces(k)
    parts = {r.part for p in marked for r in p.regions if r.exercise == k}
    for p in marked:
        for c in p.clauses(k):
            if c.id in out:
                raise ValueError(f"{c.id} is given twice (again above {p.qualname})")
            if c.part != "*" and c.part not in parts:
                raise ValueError(f"{c.id}: {k} has no part {c.part} (its parts: {sorted(parts)})")
            out[c.id] = c
    return out


def contract_docstring(piece: Piece, exercise: str, width: int = 96) -> list[str]:
    """The docstring lines (indented as the def's body) that the exercise and solution files
    give ``piece``: its contract's givens, then its clauses for ``exercise``; [] (no docstring)
    where it has neither."""
    cs = piece.clauses(exercise)
    if not cs and not (piece.given() and any(r.exercise == exercise for r in piece.regions)):
        return []
    pad = piece.body_indent
    out = []
    for g in piece.given():
        out += textwrap.wrap(f"Given: {g}", width - len(pad), initial_indent=pad,
                             subsequent_indent=pad, break_on_hyphens=False) + [""]
    if cs:
        out.append(f"{pad}Contract:")
    elif out:
        out.pop()                    # givens only: no blank line before a missing list
    for c in cs:
        out += textwrap.wrap(f"{c.id}: {c.text}", width - len(pad), initial_indent=pad + "- ",
                             subsequent_indent=pad + "  ", break_on_hyphens=False)
    out[0] = pad + '"""' + out[0][len(pad):]
    out[-1] += '"""'
    return out


def key(exercise: str) -> str:
    """"ex02" from "ex02", "ex02_data_parallel" or "exercises/ex02_data_parallel.py"."""
    m = re.search(r"ex\d+", str(exercise))
    if not m:
        raise ValueError(f"not an exercise name: {exercise!r} (e.g. 'ex02')")
    return m[0]


def stem(exercise: str) -> str:
    """"ex02_data_parallel": the name of the graded test file without ``test_``."""
    k = key(exercise)
    found = sorted(GRADED.glob(f"test_{k}_*.py"))
    if not found:
        raise ValueError(f"no graded tests for {k}: minipar/course/graded/test_{k}_<topic>.py")
    return found[0].stem.removeprefix("test_")


def learner_lines(exercise: str) -> int:
    """The lines a learner writes for ``exercise``: the non-blank, non-comment lines inside its
    marked regions (markers and ``# Hint:`` lines excluded)."""
    k = key(exercise)
    count = 0
    for p in pieces(k):
        lines = p.path.read_text().splitlines()
        for r in p.regions:
            if r.exercise == k:
                count += sum(1 for ln in lines[r.start + 1 + len(r.hints):r.end]
                             if ln.strip() and not ln.strip().startswith("#"))
    return count
