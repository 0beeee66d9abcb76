"""The library's marked regions: where a learner's code goes, read from the source.

A region sits inside a function or method, between ``# >>> exNN [PART]`` and
``# <<< exNN [PART]`` comments, with optional ``# Hint:`` lines right after the opening one
(see :mod:`minipar.course.exercise`). :func:`pieces` lists the functions and methods holding
regions; :func:`stem` names an exercise by its graded test file in :data:`GRADED`
(``minipar/course/graded/``, shipped with the package). Both the activation
(:mod:`minipar.course.exercise`) and the generator of the exercise and solution files
(:mod:`minipar.course.exercise_files`) read the markers from here."""
from __future__ import annotations

import ast
import re
import tokenize
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]   # minipar/
ROOT = PACKAGE.parent                           # the repository, or site-packages once installed
GRADED = PACKAGE / "course" / "graded"          # the graded tests, inside the package
_MARK = re.compile(r"#\s*(>>>|<<<)\s*(ex\d+)(?:\s+(\w+))?\s*$")
_HINT = re.compile(r"\s*# Hint:")


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


def _defs(body, classes=()):
    """(qualname, def node, enclosing classes) for module functions and (nested) class methods."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield ".".join([c.name for c in classes] + [node.name]), node, list(classes)
        elif isinstance(node, ast.ClassDef):
            yield from _defs(node.body, (*classes, node))


def _pieces_of(path: Path) -> list[Piece]:
    text = path.read_text()
    if ">>>" not in text:
        return []
    regions = _regions(path, text.splitlines())
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    pieces = []
    for qualname, node, classes in _defs(ast.parse(text).body):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        # the opening marker sits in the body; the closing one may follow its last statement
        inside = [r for r in regions if node.lineno - 1 < r.start < node.end_lineno - 1]
        if inside:
            last = max([node.end_lineno - 1] + [r.end for r in inside])
            pieces.append(Piece(module, path, qualname, first, last, classes, inside))
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
