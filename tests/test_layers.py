"""Dependencies point one way: minipar's modules form layers, bottom to top, each named by the
first folder of its path (the rule, stated once, is :mod:`minipar.course.layers`'s docstring):
``runtime/``; ``cost/``; the core (every other folder: the chapters' packages and what they share);
``plan/``, ``production/``, ``adapt/``, ``bench/``, ``study/``; ``course/`` and the front door.

Read from every module's source with :mod:`ast` (relative imports resolved), these tests check
that no module imports from a layer above its own (imports inside functions count too), that
no chapter's package imports a later chapter's (the composers only through that package's
``__all__``), that the core's models import no chapter's package, that no two modules import
each other at module level (directly or around a longer cycle), and that no module reads another
module's underscore names. Each failure lists every offending import with its file and line.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from importlib.util import resolve_name
from pathlib import Path

from minipar.course import layers
from minipar.course.chapters import CHAPTERS
from minipar.course.layers import layer

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"

# Known exceptions, each with its reason; an entry that no longer matches anything fails
# test_allowances_are_still_needed, so the list only shrinks.
UPWARD_ALLOWED: set = set()   # none: every import points down
PRIVATE_ALLOWED: set = set()   # none: no module reads another's underscore names


@dataclass(frozen=True)
class Import:
    module: str        # the importing module
    target: str        # the module imported from
    names: tuple       # the names taken (from-imports), () for a plain import
    line: int
    top: bool          # at module level (not inside a function)

    def where(self) -> str:
        return f"{module_path(self.module)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> str:
    return str(MODULES[name].relative_to(ROOT)) if name in MODULES else name


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
           if "graded" not in p.relative_to(PACKAGE).parts}


def _resolve(source: str, name: str | None) -> str:
    """The minipar module an import reaches: ``from pkg import sub`` is the submodule."""
    if name and f"{source}.{name}" in MODULES:
        return f"{source}.{name}"
    while source not in MODULES and "." in source:
        source = source.rpartition(".")[0]
    return source


def _named_module(node) -> str | None:
    """The module a hidden import names: ``sys.modules["minipar.x"]``, ``sys.modules.get("minipar.x")``
    or ``importlib.import_module("minipar.x")`` with a constant name."""
    arg = None
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        arg = node.slice
    elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in (
            "sys.modules.get", "importlib.import_module", "import_module", "__import__"):
        arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.split(".")[0] == "minipar":
        return arg.value
    return None


def _scan(name: str, path: Path, text: str | None = None):
    """(imports, private attribute reads) of one module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text() if text is None else text)
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    imports, aliases = [], {}   # aliases: local name -> the minipar module it is bound to
    for node in ast.walk(tree):
        top = id(node) not in in_function
        if isinstance(node, ast.ImportFrom):
            source = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            if not source or not (source == "minipar" or source.startswith("minipar.")):
                continue
            by_target: dict = {}
            for a in node.names:
                target = _resolve(source, a.name)
                by_target.setdefault(target, []).append(a.name if target == _resolve(source, None) else "")
                if target != _resolve(source, None) or target == f"{source}.{a.name}":
                    aliases[a.asname or a.name] = target
            for target, names in by_target.items():
                imports.append(Import(name, target, tuple(n for n in names if n), node.lineno, top))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "minipar" or a.name.startswith("minipar."):
                    target = _resolve(a.name, None)
                    imports.append(Import(name, target, (), node.lineno, top))
                    if a.asname:
                        aliases[a.asname] = target
        elif hidden := _named_module(node):   # a module found by name counts as an import of it
            imports.append(Import(name, _resolve(hidden, None), (), node.lineno, False))
    reads = []   # (target module, attribute, line) for alias._name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _private(node.attr)):
            reads.append((aliases[node.value.id], node.attr, node.lineno))
    return imports, reads


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


SCANS = {name: _scan(name, path) for name, path in MODULES.items()}
IMPORTS = [i for imports, _ in SCANS.values() for i in imports]


def _report(title: str, lines: list[str]) -> str:
    return f"{title} ({len(lines)}):\n" + "\n".join(f"  {ln}" for ln in sorted(lines))


def upward_imports() -> list[Import]:
    return [i for i in IMPORTS if layer(i.target) > layer(i.module)]


def test_the_rule_names_folders_that_exist():
    """Every folder the layer rule names, and every chapter's package, is a folder or module of
    ``minipar/`` (a renamed folder cannot silently fall into the core)."""
    named = [n for n in layers.FOLDERS if n] + [ch.package for ch in CHAPTERS if ch.package]
    missing = [n for n in named if not layers.files(n)]
    assert not missing, f"named by the rule but not in minipar/: {missing}"
    assert [ch.number for ch in CHAPTERS if ch.package] == sorted(layers.chapter_packages(CHAPTERS))


def test_no_import_points_up():
    """No module imports from a layer above its own, also inside a function."""
    bad = [f"{i.where()}: {i.module} ({layers.NAMES[layer(i.module)]}) imports {i.target} "
           f"({layers.NAMES[layer(i.target)]}){'' if i.top else ' inside a function'}"
           for i in upward_imports() if (i.module, i.target) not in UPWARD_ALLOWED]
    assert not bad, _report("imports from a higher layer", bad)


def test_models_import_no_strategy():
    """Within the core, the models are the ground floor: they import no chapter's package."""
    bad = [f"{i.where()}: {i.module} imports {i.target}" for i in IMPORTS
           if i.module.startswith("minipar.models") and layers.chapter_of(i.target, CHAPTERS)]
    assert not bad, _report("models importing a strategy", bad)


def exported(package: str) -> set:
    """The names a package's ``__init__.py`` lists in ``__all__`` (its face)."""
    tree = ast.parse((PACKAGE / package.split(".", 1)[1] / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def later_chapter_imports(imports) -> list[str]:
    """Imports of a later chapter's package: none, but a composer's of names that package exports."""
    bad = []
    for i in imports:
        mine, theirs = layers.chapter_of(i.module, CHAPTERS), layers.chapter_of(i.target, CHAPTERS)
        if not (mine and theirs and theirs > mine):
            continue
        face = f"minipar.{layers.top(i.target)}"
        if layers.composes(i.module) and i.target == face and i.names and set(i.names) <= exported(face):
            continue
        if not layers.composes(i.module):
            why = "not a composer"
        elif i.target != face or not i.names:
            why = "a composer may take only names its package exports"
        else:
            why = f"{', '.join(sorted(set(i.names) - exported(face)))} not in its __all__"
        bad.append(f"{i.where()}: {i.module} (chapter {mine}) imports {i.target} (chapter {theirs}): {why}")
    return bad


def test_no_chapter_imports_a_later_chapter():
    """A chapter's package imports no later chapter's package; the composers (``hybrid/``, the
    training command) take from a later one only names its ``__init__`` exports."""
    bad = later_chapter_imports(IMPORTS)
    assert not bad, _report("imports of a later chapter's package", bad)


def cycles() -> list[list[str]]:
    """Strongly connected components (more than one module, or a self-import) of the
    module-level import graph (Tarjan's algorithm)."""
    graph: dict = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.top and i.target in MODULES:
            graph[i.module].add(i.target)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """No module imports itself back through others at module level."""
    found = cycles()
    lines = []
    for comp in found:
        edges = [f"{i.where()}: {i.module} -> {i.target}" for i in IMPORTS
                 if i.top and i.module in comp and i.target in comp]
        lines.append(" <-> ".join(comp) + "\n    " + "\n    ".join(sorted(edges)))
    assert not found, _report("import cycles", lines)


def private_reads() -> list[tuple[str, str, str, int]]:
    """(module, other module, underscore name, line): ``from other import _x`` and
    ``other._x`` where ``other`` is another minipar module."""
    out = []
    for name, (imports, reads) in SCANS.items():
        for i in imports:
            out += [(name, i.target, n, i.line) for n in i.names if _private(n) and i.target != name]
        out += [(name, target, attr, line) for target, attr, line in reads if target != name]
    return out


def folder_pairs(imports) -> list[str]:
    """Pairs of folders (or top-level modules) of ``minipar/`` that import each other, each import
    counted (also inside a function): two siblings of one layer may not lean on each other, the
    shared piece belongs below both."""
    edges: dict = {}
    for i in imports:
        a, b = layers.top(i.module), layers.top(i.target)
        if a != b:
            edges.setdefault((a, b), []).append(i.where())
    return [f"{a} <-> {b}: {', '.join(edges[(a, b)])} / {', '.join(edges[(b, a)])}"
            for a, b in sorted(edges) if a < b and (b, a) in edges]


def test_no_two_folders_import_each_other():
    """No pair of folders imports each other (``plan`` and ``bench`` share the all-reduce timing
    through ``plan.calibrate``; ``adapt`` and ``production`` what a rank holds through ``minipar.pieces``)."""
    bad = folder_pairs(IMPORTS)
    assert not bad, _report("folders importing each other", bad)


def test_the_folder_rule_sees_what_it_checks():
    """On planted imports: bench -> plan and plan -> bench (inside a function) is a pair; one way is not."""
    planted = [Import("minipar.plan.calibrate", "minipar.bench.collectives", (), 1, False),
               Import("minipar.bench.planner", "minipar.plan", (), 2, True)]
    assert len(folder_pairs(planted)) == 1 and "bench <-> plan" in folder_pairs(planted)[0]
    assert folder_pairs(planted[1:]) == []


# imports inside a function without a comment of their own, each with its reason (the list only shrinks)
DEFERRED_ALLOWED = {
    # the device code of runtime/: its imports move up as it is reworked
    ("runtime/backend.py", "import socket"), ("runtime/backend.py", "import platform"),
    ("runtime/backend.py", "import torch.distributed as dist"), ("runtime/flight.py", "import torch.distributed as dist"),
    ("runtime/gpu.py", "from .backend import default_device, gpu_count"), ("runtime/pool.py", "import json"),
    ("runtime/trace.py", "import torch.distributed as dist"), ("runtime/trace.py", "import torch"),
    # chapter 12's switches and their options, being reworked likewise
    ("adapt/auto.py", "from ..plan.course import predict_compare"),
}


def deferred_imports() -> list[tuple[str, int, str, bool]]:
    """``(file, line, statement, commented)`` of every import inside a function, outside ``course/``:
    ``commented`` when its line, or the line above it, carries a comment (the reason)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("course/"):
            continue
        text = path.read_text()
        lines, tree, seen = text.splitlines(), ast.parse(text), set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                        seen.add(id(node))
                        near = lines[node.end_lineno - 1] + lines[node.lineno - 2].strip()[:1]
                        out.append((rel, node.lineno, ast.unparse(node), "#" in near))
    return out


def test_imports_inside_functions_say_why():
    """An import inside a function (outside ``course/``) breaks a real cycle or defers a heavy or
    optional dependency, and says which in a comment; any other import sits at the module's top."""
    bad = [f"minipar/{f}:{n}: {stmt}" for f, n, stmt, commented in deferred_imports()
           if not commented and (f, stmt) not in DEFERRED_ALLOWED]
    assert not bad, _report("imports inside functions without a reason", bad)
    left = {(f, stmt) for f, _, stmt, commented in deferred_imports() if not commented}
    assert DEFERRED_ALLOWED <= left, DEFERRED_ALLOWED - left


def test_no_module_reads_another_modules_private_names():
    """Underscore names stay inside their module: no ``from x import _y``, no ``x._y``."""
    bad = [f"{module_path(m)}:{line}: {m} reads {other}.{attr}"
           for m, other, attr, line in private_reads() if (m, other, attr) not in PRIVATE_ALLOWED]
    assert not bad, _report("private names read across modules", bad)


def test_allowances_are_still_needed():
    """Every allow-list entry still matches an import (fixed ones leave the list)."""
    upward = {(i.module, i.target) for i in upward_imports()}
    private = {(m, o, a) for m, o, a, _ in private_reads()}
    stale = sorted(map(str, (UPWARD_ALLOWED - upward) | (PRIVATE_ALLOWED - private)))
    assert not stale, _report("allow-list entries that match nothing", stale)


PLANTED_CHAPTERS = {
    "minipar.model_parallel.planted": "from ..pipeline import partition\n",            # 03 -> 04
    "minipar.hybrid.planted": "from ..context_parallel import apply_cp\n"               # a composer,
                              "from ..context_parallel.ring import schedule\n"          # but a module
                              "from ..expert_parallel import _private_thing\n",         # not exported
    "minipar.production.train_options": "from ..adapt import parse_switches\n",        # exported
}


def test_the_chapter_rule_sees_what_it_checks():
    """On planted modules: chapter 03 reaching into chapter 04 is refused, a composer's import of
    a later package's exported name passes, of a module inside it or an unexported name fails."""
    planted = [i for name, text in PLANTED_CHAPTERS.items()
               for i in _scan(name, PACKAGE / name.split(".", 1)[1].replace(".", "/") / "x.py", text)[0]]
    bad = later_chapter_imports(planted)
    assert len(bad) == 3, bad
    assert "model_parallel.planted (chapter 03) imports minipar.pipeline (chapter 04): not a composer" in bad[0]
    assert "minipar.context_parallel.ring (chapter 08): a composer may take only" in bad[1]
    assert "_private_thing not in its __all__" in bad[2]
    assert layers.chapter_of("minipar.pipeline.executor", CHAPTERS) == "04"
    assert layers.chapter_of("minipar.mesh", CHAPTERS) is None


PLANTED = """
import sys
from .pool import _pool
from ..course import exercise as ex

def f():
    from ..models import gpt
    return sys.modules.get("minipar.course.grade"), ex._active, gpt
"""


def test_the_checker_sees_what_it_checks():
    """The scan itself: on a planted module of the runtime it sees every way in (relative,
    inside a function, a module found through ``sys.modules``, ``alias._name``), and on the
    package the imports it is known to hold."""
    imports, reads = _scan("minipar.runtime.planted", PACKAGE / "runtime" / "planted.py", PLANTED)
    assert {(i.target, i.top) for i in imports} == {
        ("minipar.runtime.pool", True), ("minipar.course.exercise", True), ("minipar.models.gpt", False),
        ("minipar.course.grade", False)}, imports
    assert [n for i in imports for n in i.names] == ["_pool"] and [(t, a) for t, a, _ in reads] == [
        ("minipar.course.exercise", "_active")]
    got = {(i.module, i.target, i.top) for i in IMPORTS}
    assert ("minipar.runtime.launch", "minipar.runtime.trace", True) in got   # from . import trace
    assert ("minipar.course.grade", "minipar.course.challenge", True) in got  # from .challenge import
    assert layer("minipar.cost.pipeline") == layers.COST and layer("minipar.pipeline.train") == layers.CORE
    assert layer("minipar") == layers.COURSE and layer("minipar.plan.layout") == layers.BUILT_ON_CORE
    assert layer("minipar.study.plots.pipeline") == layers.BUILT_ON_CORE and layer("minipar.memory") == layers.CORE
    assert any(not top for _, _, top in got), "imports inside functions are read too"
