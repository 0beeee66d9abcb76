"""Challenges: one open task per chapter, graded by a measured goal rather than a fixed answer.

The learner's file is ``exercises/challenges/chNN_topic.py`` (its docstring states the task,
the goal and how it is measured; its functions raise ``NotImplementedError("Challenge NN:
name")`` until written). ``solutions/challenges/chNN_topic.py`` is one way to pass and
``minipar/course/graded/alternatives/chNN_topic.py`` a second, different one: the proof that the goal,
not an answer, is graded. ``minipar/course/graded/test_chNN_topic.py`` (``CHALLENGE = "chNN_topic"``)
measures what the ``challenge`` fixture's module does; ``minipar.grade("exNN")`` runs it after
the chapter's core exercise.
"""
from __future__ import annotations

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
    return load_file(path, f"minipar_challenge_{target}_{name}")


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
