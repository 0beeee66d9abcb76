"""Challenges: one open task per chapter, graded by a measured goal rather than a fixed answer.

The learner's file is ``exercises/challenges/chNN_topic.py`` (its docstring states the task,
the goal and how it is measured; its functions raise ``NotImplementedError("Challenge NN:
name")`` until written). ``solutions/challenges/chNN_topic.py`` is one way to pass and
``minipar/course/graded/alternatives/chNN_topic.py`` a second, different one: the proof that the goal,
not an answer, is graded. ``minipar/course/graded/test_chNN_topic.py`` (``CHALLENGE = "chNN_topic"``)
measures what the ``challenge`` fixture's module does; ``minipar.grade("chNN")`` grades it
alone, ``minipar.grade("exNN")`` after the chapter's core exercise.

A challenge must not be passable by calling the library's own answer: its graded module may
set ``FORBIDDEN = ("minipar.pipeline.schedules", ...)`` (modules, or names inside one), and
:func:`load` then refuses a learner's file that imports any of them, in any form (``import
a.b``, ``from a import b``, ``from a.b import c``, ``importlib.import_module("a.b")``, or a
dotted use ``a.b.c`` of an imported package, through its alias too), naming the line. List
the names a package re-exports as well (``"minipar.pipeline.zb_h1"`` beside
``"minipar.pipeline.schedules"``): ``from minipar.pipeline import zb_h1`` names no module.
"""
from __future__ import annotations

import ast
import os
import re
import types
from contextlib import contextmanager
from pathlib import Path

from .exercise import EXERCISES_ENV, load_file
from .markers import GRADED, ROOT

TARGETS = ("exercise", "solution", "alternative")
GRADED_ENV = "MINIPAR_GRADED"  # another directory of graded tests (the grader's own tests use one)


def graded_dir() -> Path:
    """The graded tests: ``minipar/course/graded`` (shipped with the package), or ``$MINIPAR_GRADED``."""
    return Path(os.environ[GRADED_ENV]) if os.environ.get(GRADED_ENV) else GRADED


def directory(target: str) -> Path:
    """Where ``target``'s challenge files live."""
    if target == "exercise":
        return Path(os.environ[EXERCISES_ENV]) / "challenges" if os.environ.get(EXERCISES_ENV) \
            else ROOT / "exercises" / "challenges"
    if target == "solution":
        return ROOT / "solutions" / "challenges"
    if target == "alternative":
        return graded_dir() / "alternatives"
    raise ValueError(f"challenge target must be one of {TARGETS}, got {target!r}")


def load(name: str, target: str = "exercise") -> types.ModuleType:
    """``target``'s module for challenge ``name`` (``"ch04_pipeline"``), freshly imported (edits
    count); its functions pickle by value, so :func:`minipar.runtime.launch` can run them on ranks."""
    path = directory(target) / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"challenge {name}: no file {path}")
    if target == "exercise" and (banned := forbidden(name)):
        refuse_imports(path, banned)
    return load_file(path, f"minipar_challenge_{target}_{name}")


def forbidden(name: str) -> tuple[str, ...]:
    """The graded module's ``FORBIDDEN`` (read without importing it): what the learner's file of
    challenge ``name`` may not import; ``()`` when it sets none."""
    m = re.match(r"ch\d+", name)
    found = sorted(graded_dir().glob(f"test_{m[0]}_*.py")) if m else []
    for node in ast.parse(found[0].read_text()).body if found else []:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FORBIDDEN" for t in node.targets):
            value = ast.literal_eval(node.value)
            return (value,) if isinstance(value, str) else tuple(value)
    return ()


def _dotted(node) -> str | None:
    """``a.b.c`` for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything the file at ``path`` imports or names by a dotted path:
    ``import a.b`` gives a.b; ``from a import b`` gives a and a.b; ``importlib.import_module("a.b")``
    and ``__import__("a.b")`` with a literal give a.b; an expression ``x.c`` gives a.b.c where
    ``x`` was bound to a.b by an import (``import a.b as x``, ``from a import b as x``)."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node.lineno, a.name))
                if a.asname:
                    bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            for a in node.names:
                out.append((node.lineno, f"{node.module}.{a.name}"))
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and (_dotted(node.func) or "").split(".")[-1] in ("import_module", "__import__"):
            out.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Attribute) and (d := _dotted(node)):
            head, _, rest = d.partition(".")
            out.append((node.lineno, f"{bound[head]}.{rest}" if head in bound else d))
    return sorted(set(out))


def refuse_imports(path: Path, banned) -> None:
    """A :class:`minipar.course.grading.GradeFailure` naming the first line of ``path`` that
    imports a ``banned`` module or name (or one inside it)."""
    from .grading import GradeFailure
    for line, name in imported(path):
        hit = next((b for b in banned if name == b or name.startswith(b + ".")), None)
        if hit:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            code = path.read_text().splitlines()[line - 1].strip()
            raise GradeFailure(f"{shown}:{line}  {code}\n  this challenge is graded without {hit} "
                               f"(the library's own answer); your file imports it")


@contextmanager
def watched(name: str):
    """While a challenge's tests run: the library's own code for the chapter's exercise is active
    (``minipar.exercise("exNN", target="library")``, which changes nothing), so that every rank
    launched checks its exchanges' sizes and, while grading, reports a hang rank by rank as
    the core exercise's tests do."""
    from . import exercise
    chapter = re.search(r"ch(\d+)", name)
    ex = f"ex{chapter[1]}" if chapter else None
    if ex is None or ex not in exercise.exercises():
        yield
        return
    with exercise.Activation(ex, "library"):
        yield
