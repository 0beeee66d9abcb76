"""Write ``exercises/exNN_topic.py`` and ``solutions/exNN_topic.py`` from the library's markers.

``python -m minipar.course.exercise --write`` (or ``--check``; ``--count`` prints the lines a
learner writes per exercise, :func:`minipar.course.markers.learner_lines`, and their total). For every exercise (see
:mod:`minipar.course.markers`), both files hold, module by module, the library's functions and
methods that contain the exercise's marked regions, whole, under a comment naming their module
and with the imports their code needs; a method comes inside its class, which holds only the
marked methods. In the exercise file each region is replaced by its hint lines and
``raise NotImplementedError("Exercise NN X: qualname")``; in the solution file it is the
library's code. Both files' docstring is that of ``minipar/course/graded/test_exNN_topic.py``."""
from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import importlib.util
import textwrap
from itertools import groupby
from pathlib import Path

from .markers import GRADED, ROOT, Piece, exercises, key, learner_lines, pieces, stem

BANNER = "# " + "-" * 96


def _body(p: Piece, exercise: str, solution: bool) -> list[str]:
    """The piece's source lines, with the exercise's regions stubbed (or just unmarked)."""
    lines = p.path.read_text().splitlines()
    out, i = [], p.first
    for r in sorted(p.regions, key=lambda r: r.start):
        out += lines[i:r.start]
        if solution or r.exercise != exercise:   # a solution, or another exercise's region: the code
            out += lines[r.start + 1 + len(r.hints):r.end]
        else:
            out += r.hints + [f'{r.indent}raise NotImplementedError("{r.label()}: {p.qualname}")']
        i = r.end + 1
    return out + lines[i:p.last + 1]


def _imports(module: str, code: str, defined: set[str]) -> list[str]:
    """Import lines for the names ``code`` takes from ``module``'s namespace: the module's own
    import statements (made absolute) where it imported them, else ``from module import``."""
    mod = importlib.import_module(module)
    used = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
    used = {n for n in used if n in vars(mod) and n not in defined and not hasattr(builtins, n)}
    package = mod.__package__ or ""
    plain, froms = set(), {}
    for node in ast.parse(Path(mod.__file__).read_text()).body:
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]
                if bound in used:
                    plain.add(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
                    used.discard(bound)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            for a in node.names:
                bound = a.asname or a.name
                if bound in used:
                    froms.setdefault(source, set()).add(a.name + (f" as {a.asname}" if a.asname else ""))
                    used.discard(bound)
    if used:
        froms.setdefault(module, set()).update(used)
    return sorted(plain) + [f"from {m} import {', '.join(sorted(ns))}" for m, ns in sorted(froms.items())]


def _section(module: str, group: list[Piece], exercise: str, solution: bool,
             defined: set[str]) -> list[str]:
    """One library module's pieces: a banner naming the module, imports, then the code."""
    chunks, full = [], []
    classes: list = []                    # the class headers already open in this section
    for p in group:
        depth = len(p.classes)     # keep the open classes that also enclose p, close the others
        common = next((i for i, (a, b) in enumerate(zip(classes, p.classes)) if a is not b),
                      min(depth, len(classes)))
        classes = classes[:common]
        for c in p.classes[common:]:
            pad = "    " * len(classes)
            bases = ", ".join([ast.unparse(b) for b in c.bases] + [ast.unparse(k) for k in c.keywords])
            qual = ".".join(x.name for x in p.classes[:len(classes) + 1])
            doc = textwrap.wrap(f"Only the marked methods of ``{module}.{qual}``; the rest of the "
                                "class is the library's.", 92 - len(pad))
            doc[0], doc[-1] = '"""' + doc[0], doc[-1] + '"""'
            chunks += ["", "", f"{pad}class {c.name}({bases}):" if bases else f"{pad}class {c.name}:",
                       *[f"{pad}    {ln}" for ln in doc]]
            classes.append(c)
        body = textwrap.dedent("\n".join(_body(p, exercise, solution))).splitlines()
        full.append(textwrap.dedent("\n".join(_body(p, exercise, True))))
        chunks += [""] * (1 if depth else 2) + ["    " * depth + ln if ln else "" for ln in body]
    head = ["", "", BANNER, f"# from {p.path.relative_to(ROOT)}: these run as module {module}'s own", BANNER]
    return head + _imports(module, "\n".join(full), defined) + chunks


def render(exercise: str, solution: bool) -> str:
    """The text of ``exercises/`` (or ``solutions/``) ``exNN_topic.py`` for ``exercise``."""
    k = key(exercise)
    marked = pieces(k)
    if not marked:
        raise ValueError(f"{k}: no marked regions in minipar")
    graded = GRADED / f"test_{stem(k)}.py"
    doc = ast.get_docstring(ast.parse(graded.read_text()), clean=False)
    if not doc:
        raise ValueError(f"{graded.relative_to(ROOT)} needs a module docstring (the exercise's statement)")
    defined = {p.qualname.split(".")[0] for p in marked}
    target = ', target="solution"' if solution else ""
    how = ("This is the solution: the library's own marked code;" if solution else
           "Replace each `raise NotImplementedError` with your code;")
    lines = [f'"""{doc}"""', "# Generated by `python -m minipar.course.exercise --write` from minipar's marked code.",
             f'# {how} `with minipar.exercise("{k}"{target}):`',
             "# runs the library with the functions below in place of its own (in every rank too).",
             "from __future__ import annotations"]
    for module, group in groupby(marked, key=lambda p: p.module):  # consecutive pieces of a module
        lines += _section(module, list(group), k, solution, defined)
    lines += ["", "", f"if __name__ == \"__main__\":  # python {'solutions' if solution else 'exercises'}/"
              f"{stem(k)}.py grades this file", "    import minipar", f'    minipar.grade("{k}"{target})']
    return "\n".join(lines) + "\n"


def outputs() -> tuple[dict, list[str]]:
    """({path: text} of every generated file, [what keeps an exercise from being generated])."""
    out, problems = {}, []
    for k in exercises():
        try:
            for folder, solution in (("exercises", False), ("solutions", True)):
                out[ROOT / folder / f"{stem(k)}.py"] = render(k, solution)
        except (ValueError, ImportError) as e:
            problems.append(f"{k}: {e}")
    return out, problems


def count_table() -> str:
    """The lines a learner writes, per exercise and in all (Markdown)."""
    counts = {k: learner_lines(k) for k in exercises()}
    return "\n".join(["| exercise | learner lines |", "|---|---|",
                      *[f"| {k} | {n} |" for k, n in counts.items()],
                      f"| all | {sum(counts.values())} |"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minipar.course.exercise", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="(re)write exercises/ and solutions/")
    ap.add_argument("--check", action="store_true", help="fail if a committed file differs")
    ap.add_argument("--count", action="store_true",
                    help="print the lines a learner writes per exercise (non-blank, non-comment lines "
                         "of its marked regions) and the total")
    a = ap.parse_args(argv)
    if a.count:
        print(count_table())
        if not (a.write or a.check):
            return 0
    if not (a.write or a.check):
        ap.error("give --write, --check or --count")
    stale, (files, problems) = [], outputs()
    for problem in problems:
        print(f"cannot generate: {problem}")
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if a.write:
                path.write_text(text)
            print(f"{'wrote' if a.write else 'differs from the generator'}: {path.relative_to(ROOT)}")
    return 1 if problems or (stale and a.check) else 0
