"""Dependencies point one way: minipar's modules form layers, bottom to top,

1. ``runtime/``: launching ranks, the pool, devices, the trace;
2. ``analysis/cost/``: the cost model's pure formulas;
3. the core: ``comm/``, ``models/``, ``autograd/`` (the split backward), ``activations``,
   ``data``, ``precision``, ``mesh``, ``reference``, ``strategy`` and every strategy package;
4. what is built on the core: ``production/``, ``analysis/plan/``, ``bench/``;
5. the course (``course/``) and the package's front door (``minipar/__init__.py``, the
   ``grade``/``hint``/``train`` shims).

Read from every module's source with :mod:`ast` (relative imports resolved), these tests check
that no module imports from a layer above its own (imports inside functions count too), that
the core's models import no strategy, that no two modules import each other at module level
(directly or around a longer cycle), and that no module reads another module's underscore
names. Each failure lists every offending import with its file and line.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from importlib.util import resolve_name
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"

# bottom to top; a module belongs to the layer of the longest prefix that names it
STRATEGIES = ["minipar.data_parallel", "minipar.model_parallel", "minipar.pipeline",
              "minipar.tensor_parallel", "minipar.zero", "minipar.context_parallel",
              "minipar.expert_parallel", "minipar.hybrid"]
LAYERS = [
    ("runtime", ["minipar.runtime"]),
    ("cost formulas", ["minipar.analysis.cost"]),
    ("core", ["minipar.comm", "minipar.models", "minipar.autograd", "minipar.activations",
              "minipar.data", "minipar.precision", "minipar.mesh", "minipar.reference", "minipar.measured",
              "minipar.strategy", *STRATEGIES]),
    ("built on the core", ["minipar.production", "minipar.adapt", "minipar.analysis.plan", "minipar.bench",
                           "minipar.analysis"]),
    ("course", ["minipar.course", "minipar.grade", "minipar.hint", "minipar.train", "minipar"]),
]
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


def layer(module: str) -> int:
    best = max(((len(p), k) for k, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[1]


def _report(title: str, lines: list[str]) -> str:
    return f"{title} ({len(lines)}):\n" + "\n".join(f"  {ln}" for ln in sorted(lines))


def upward_imports() -> list[Import]:
    return [i for i in IMPORTS if layer(i.target) > layer(i.module)]


def test_every_module_has_a_layer():
    """Every module of the package sits in one of the layers (a new folder must be placed)."""
    for module in MODULES:
        layer(module)


def test_no_import_points_up():
    """No module imports from a layer above its own, also inside a function."""
    bad = [f"{i.where()}: {i.module} ({LAYERS[layer(i.module)][0]}) imports {i.target} "
           f"({LAYERS[layer(i.target)][0]}){'' if i.top else ' inside a function'}"
           for i in upward_imports() if (i.module, i.target) not in UPWARD_ALLOWED]
    assert not bad, _report("imports from a higher layer", bad)


def test_models_import_no_strategy():
    """Within the core, the models are the ground floor: they import no strategy package."""
    bad = [f"{i.where()}: {i.module} imports {i.target}" for i in IMPORTS
           if i.module.startswith("minipar.models")
           and any(i.target == s or i.target.startswith(s + ".") for s in STRATEGIES)]
    assert not bad, _report("models importing a strategy", bad)


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
    assert layer("minipar.analysis.cost.pipeline") == 1 and layer("minipar.pipeline.train") == 2
    assert layer("minipar") == 4 and layer("minipar.analysis.plan.layout") == 3
    assert any(not top for _, _, top in got), "imports inside functions are read too"
