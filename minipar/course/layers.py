"""The package's layers and the chapters' packages, read from the folders (nothing to register).

A module's **layer** is named by the first folder (or top-level module) of its path under
``minipar/``, and imports only point down, from a layer to itself or one below:

1. ``runtime/``: plumbing that knows nothing of any strategy (launching ranks, the pool, devices,
   the trace, the flight recorder, host staging, the pictures);
2. ``cost/``: the formulas, pure functions of sizes, so the core can show them beside its
   measurements;
3. the **core**: every other folder and module at the top of ``minipar/``: the chapters'
   packages and what they share (``models/``, ``autograd/``, ``strategy.py``, ``reference.py``,
   ``mesh.py``, ``data.py``, ``precision.py``, ``activations.py``, ``memory.py``). A new folder is
   core unless it is named below;
4. **built on the core**: ``plan/`` (the planner), ``production/`` (the training command, faults,
   checkpoints), ``adapt/`` (parallelism that adapts), ``pieces/`` (what a rank holds, as pieces of
   the single-device model: what checkpoints and adapt's reshard share), ``bench/`` (benchmarks) and
   ``study/`` (figures, comparisons, toy runs). Two of them never import each other (the piece they
   share goes below both);
5. the **course**: ``course/``, and the front door: ``minipar/__init__.py`` and the three
   command modules ``grade.py``, ``hint.py``, ``train.py``.

A **chapter's package** is the folder its :class:`~minipar.course.chapters.Chapter` names
(``package``; the functions below are handed that list, which stays the one place); a module
belongs to the chapter whose package holds it. A chapter's package imports
no later chapter's package, with one exception, the **composers**, which put later chapters
together: ``hybrid/`` (chapter 07: ``parallelize`` nests tensor, context, expert, pipeline and data
parallelism) and the training command (``production/train.py``, ``train_options.py``: chapter 11,
driving chapter 12's switches). A composer takes from a later chapter only what that chapter's
package exports (a name in its ``__init__``'s ``__all__``), never a module inside it.

A chapter's **core** (README's core map) is every file of its package that defines something
(a package's ``__init__.py`` that only re-exports is its face, not its core), and every top-level
core module whose marked exercise regions are that chapter's alone (``mesh.py``: exercise 07).
The rest of the core is **shared**. Standard library only: README's generator reads it.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]   # minipar/

RUNTIME, COST, CORE, BUILT_ON_CORE, COURSE = 1, 2, 3, 4, 5
NAMES = {RUNTIME: "runtime", COST: "cost formulas", CORE: "core", BUILT_ON_CORE: "built on the core",
         COURSE: "course"}
# the first folder (or top-level module) of a path under minipar/ -> its layer; any other is core
FOLDERS = {"runtime": RUNTIME, "cost": COST,
           "plan": BUILT_ON_CORE, "production": BUILT_ON_CORE, "adapt": BUILT_ON_CORE, "bench": BUILT_ON_CORE,
           "study": BUILT_ON_CORE, "pieces": BUILT_ON_CORE,
           "course": COURSE, "grade": COURSE, "hint": COURSE, "train": COURSE, "": COURSE}
# the composers' modules: a later chapter's package face is open to them
COMPOSERS = ("minipar.hybrid", "minipar.production.train", "minipar.production.train_options")
_MARK = re.compile(r"#\s*>>>\s*(ex\d+)")


def top(module: str) -> str:
    """The first folder or top-level module of ``minipar.x.y`` (``"x"``); ``""`` for ``minipar``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    """The layer of a dotted module name under ``minipar``, by its first folder."""
    return FOLDERS.get(top(module), CORE)


def chapter_packages(chapters) -> dict[str, str]:
    """Chapter number -> the top-level name of its package, for the chapters that name one."""
    return {ch.number: ch.package for ch in chapters if ch.package}


def chapter_of(module: str, chapters) -> str | None:
    """The chapter whose package holds ``module`` (``"04"``), or None."""
    return {pkg: n for n, pkg in chapter_packages(chapters).items()}.get(top(module))


def composes(module: str) -> bool:
    """Whether ``module`` is one of the composers (module docstring)."""
    return any(module == c or module.startswith(c + ".") for c in COMPOSERS)


def files(name: str) -> list[str]:
    """The ``.py`` files under ``minipar/`` of a top-level folder or module, relative to ``minipar/``."""
    folder = PACKAGE / name
    if folder.is_dir():
        return sorted(str(p.relative_to(PACKAGE)) for p in folder.rglob("*.py"))
    return [f"{name}.py"] if (PACKAGE / f"{name}.py").exists() else []


def is_face(rel: str) -> bool:
    """An ``__init__.py`` that defines nothing (no function, class or assignment but ``__all__``)."""
    if not rel.endswith("__init__.py"):
        return False
    tree = ast.parse((PACKAGE / rel).read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return False
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(not (isinstance(t, ast.Name) and t.id == "__all__") for t in targets):
                return False
    return True


def exercises_in(rel: str) -> set[str]:
    """The exercises (``"ex07"``) whose regions are marked in ``minipar/rel``."""
    return set(_MARK.findall((PACKAGE / rel).read_text()))


def core_files(chapters) -> tuple[dict[str, list[str]], list[str]]:
    """(chapter -> its core files, the shared core files), for the chapters whose package is core;
    paths relative to ``minipar/`` (module docstring)."""
    packages = chapter_packages(chapters)
    exercise = {ch.exercise[:4]: ch.number for ch in chapters if ch.exercise}
    core_names = sorted({p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
                         if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
                         and p.name != "__init__.py" and layer(f"minipar.{p.stem if p.is_file() else p.name}") == CORE})
    chapters = {n: [f for f in files(pkg) if not is_face(f)] for n, pkg in packages.items() if pkg in core_names}
    shared = []
    for name in core_names:
        if name in packages.values():
            continue
        for f in files(name):
            owners = {exercise[e] for e in exercises_in(f) if e in exercise}
            if "/" not in f and len(owners) == 1 and next(iter(owners)) in chapters:
                chapters[next(iter(owners))].append(f)
            elif not is_face(f):
                shared.append(f)
    return dict(sorted(chapters.items())), shared
