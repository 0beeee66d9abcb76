"""Write ``exercises/exNN_topic.py`` and ``solutions/exNN_topic.py`` from the library's markers.

``python -m minipar.course.exercise --write`` (or ``--check``; ``--count`` prints the lines a
learner writes per exercise, :func:`minipar.course.markers.learner_lines`, and their total;
``--clauses`` every core's contract clauses beside the graded tests that observe them,
:func:`minipar.course.contracts.clause_table`). For every exercise (see
:mod:`minipar.course.markers`), both files hold, module by module, the library's functions and
methods that contain the exercise's marked regions, whole, under a comment naming their module
and with the imports their code needs; a method comes inside its class, which holds only the
marked methods. In the exercise file each region is replaced by its hint lines and
``raise NotImplementedError("Exercise NN X: qualname")``; in the solution file it is the
library's code. Both files' docstring is that of ``minipar/course/graded/test_exNN_topic.py``.

The learner's own folder is theirs: the course's tests grade *fresh* stubs
(:func:`write_stubs` into a temporary directory), and check a committed ``exercises/`` file
against the generator only in CI or while it is identical to git HEAD's (:func:`untouched`).
:func:`reset` (``python -m minipar.grade --reset ex02``) puts a stub back, keeping the
learner's file in ``exercises/.backup/``. A challenge's stub is not generated: its pristine
text is git HEAD's (:func:`stub_text`)."""
from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import importlib.util
import os
import re
import subprocess
import textwrap
import time
from itertools import groupby
from pathlib import Path

from .markers import (GRADED, ROOT, Piece, contract_docstring, exercises, key, learner_lines,
                      pieces, stem)

BANNER = "# " + "-" * 96
READING = """\
# How to read around this exercise: each docstring below is a contract, clauses {k}.P.word that
# must hold (the grader names the clause a failure breaks); the steps are yours to design. Read
# the notebook, this file and, for each library name this file imports, its signature and
# docstring (help(name)): they say what it does, not how you use it. The library's own source of
# the functions below is their solution: do not open it; nor minipar/bench/, whose baselines
# (some written here on PyTorch's collectives, such as chapter 09's token dispatch) solve what the
# exercises ask. Stuck? minipar.hint("{k}") lists the parts (an exercise of one part: shows its
# next tier); each call for a part shows one more tier (a nudge, the idea, the steps)."""


def _body(p: Piece, exercise: str, solution: bool) -> list[str]:
    """The piece's source lines, with the exercise's regions stubbed (or just unmarked) and its
    docstring replaced by its contract (:func:`minipar.course.markers.contract_docstring`)."""
    lines = p.path.read_text().splitlines()
    out, i = [], p.first
    contract = contract_docstring(p, exercise)
    if p.doc:
        out, i = lines[p.first:p.doc[0]] + contract, p.doc[1] + 1
    elif contract:
        first = _first_statement(p, lines)
        out, i = lines[p.first:first] + contract, first
    for r in sorted(p.regions, key=lambda r: r.start):
        out += lines[i:r.start]
        if solution or r.exercise != exercise:   # a solution, or another exercise's region: the code
            out += lines[r.start + 1 + len(r.hints):r.end]
        else:
            out += r.hints + [f'{r.indent}raise NotImplementedError("{r.label()}: {p.qualname}")']
        i = r.end + 1
    return out + lines[i:p.last + 1]


def _first_statement(p: Piece, lines: list[str]) -> int:
    """The 0-based line of the first statement (or marker) of ``p``'s body."""
    node = next(n for q, n, _ in _walk(ast.parse(p.path.read_text()).body) if q == p.qualname)
    first = node.body[0].lineno - 1
    marks = [r.start for r in p.regions if r.start < first]
    return min([first] + marks)


def _walk(body, prefix=""):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node, None
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node.body, f"{prefix}{node.name}.")


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


_RELATIVE = re.compile(r"^(\s*)from (\.+)([\w.]*) import ")


def absolute_import(line: str, package: str) -> str:
    """``line`` with a relative ``from .x import y`` made absolute: the generated file runs the
    code as its library module's own, but is itself no module of that package."""
    m = _RELATIVE.match(line)
    if not m:
        return line
    source = importlib.util.resolve_name(m[2] + m[3], package)
    return f"{m[1]}from {source} import " + line[m.end():]


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
                                "class is the library's (a method you add here is not seen: write "
                                "helpers as functions of this file).", 92 - len(pad))
            doc[0], doc[-1] = '"""' + doc[0], doc[-1] + '"""'
            full.append(f"class {c.name}({bases}): pass")   # the names its bases use need imports too
            chunks += ["", "", f"{pad}class {c.name}({bases}):" if bases else f"{pad}class {c.name}:",
                       *[f"{pad}    {ln}" for ln in doc]]
            classes.append(c)
        package = importlib.import_module(module).__package__ or ""
        body = [absolute_import(ln, package) for ln in
                textwrap.dedent("\n".join(_body(p, exercise, solution))).splitlines()]
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
             *READING.format(k=k).splitlines(),
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


# ----------------------------------------------------------------------------- the learner's folder
def head_text(path: Path, root: Path = ROOT) -> str | None:
    """``path``'s text at git HEAD of the repository ``root``; None where there is no git, no
    repository or no such committed file (an installed package, a fresh file)."""
    try:
        rel = Path(path).resolve().relative_to(Path(root).resolve())
        out = subprocess.run(["git", "-C", str(root), "show", f"HEAD:{rel.as_posix()}"],
                             capture_output=True, timeout=30)
    except (ValueError, OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode() if out.returncode == 0 else None


def untouched(path: Path, root: Path = ROOT) -> bool:
    """Whether ``path`` is identical to its committed version at git HEAD (False without git)."""
    committed = head_text(path, root)
    return committed is not None and Path(path).exists() and Path(path).read_text() == committed


def is_challenge_stub(text: str) -> bool:
    """Whether a challenge file is still unwritten: every function and method body (after its
    docstring) is one ``raise NotImplementedError(...)``."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    def raises(d):
        body = d.body[1:] if d.body and isinstance(d.body[0], ast.Expr) and \
            isinstance(getattr(d.body[0], "value", None), ast.Constant) else d.body
        return len(body) == 1 and isinstance(body[0], ast.Raise) and \
            "NotImplementedError" in ast.unparse(body[0])
    return bool(defs) and all(raises(d) for d in defs)


def challenge_names() -> list[str]:
    """"ch04_schedule", ...: the challenges with a graded module."""
    return sorted(p.stem.removeprefix("test_") for p in GRADED.glob("test_ch[0-9][0-9]_*.py"))


def challenge_name(name: str) -> str:
    """"ch04_schedule" for "ch04"; a ``ValueError`` naming the known ones for anything else."""
    m = re.match(r"ch\d+", name)
    full = next((c for c in challenge_names() if m and c.startswith(m[0] + "_")), None)
    if full is None:
        raise ValueError(f"no exercise or challenge {name!r}; known: "
                         f"{', '.join(exercises() + [c[:4] for c in challenge_names()])}")
    return full


def stub_text(name: str, root: Path = ROOT) -> str | None:
    """The pristine learner's file for ``name`` ("ex02", "ch04"): an exercise's from the
    generator; a challenge's from git HEAD, else the file itself if it is still a stub (None:
    no pristine copy to be found)."""
    if re.match(r"ex\d+", name):
        return render(name, solution=False)
    full = challenge_name(name)
    path = Path(root) / "exercises" / "challenges" / f"{full}.py"
    committed = head_text(path, root)
    if committed is not None:
        return committed
    return path.read_text() if path.exists() and is_challenge_stub(path.read_text()) else None


def learner_path(name: str, exercises_dir: str | os.PathLike | None = None) -> Path:
    """The learner's file for ``name`` ("ex02" or "ch04") in ``exercises_dir`` (default
    ``$MINIPAR_EXERCISES``, else ``exercises/``)."""
    base = Path(exercises_dir or os.environ.get("MINIPAR_EXERCISES") or ROOT / "exercises")
    if re.match(r"ex\d+", name):
        return base / f"{stem(name)}.py"
    full = challenge_name(name)
    return base / "challenges" / f"{full}.py"


def write_stubs(directory: str | os.PathLike) -> list[str]:
    """Every pristine learner's file (:func:`stub_text`) into ``directory``, in the layout of
    ``exercises/``; returns the challenges left out for want of a pristine copy."""
    directory = Path(directory)
    (directory / "challenges").mkdir(parents=True, exist_ok=True)
    for k in exercises():
        (directory / f"{stem(k)}.py").write_text(stub_text(k))
    missing = []
    for full in challenge_names():
        text = stub_text(full[:4])
        if text is None:
            missing.append(full[:4])
        else:
            (directory / "challenges" / f"{full}.py").write_text(text)
    return missing


def reset(name: str, exercises_dir: str | os.PathLike | None = None) -> str:
    """Put the stub of ``name`` ("ex02", "ch04") back in the learner's folder, the learner's
    file kept in ``.backup/`` beside it (``exercises/.backup/ex02_data_parallel.<time>.py``);
    returns what was done, in words. Unknown names raise ``ValueError``."""
    if not re.fullmatch(r"(ex|ch)\d+\w*", str(name)):
        raise ValueError(f"not an exercise or challenge name: {name!r} (e.g. 'ex02' or 'ch04')")
    name = str(name)[:4]
    path = learner_path(name, exercises_dir)
    text = stub_text(name)
    if text is None:
        raise ValueError(f"{name}: no pristine copy of {path.name} (no git history here)")
    base = path.parent.parent if path.parent.name == "challenges" else path.parent
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    if path.exists() and path.read_text() == text:
        return f"{shown} is already the stub; nothing changed"
    said = f"reset {shown} to its stub"
    if path.exists():
        stamp = f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}"
        backup, i = base / ".backup" / f"{stamp}.py", 1
        while backup.exists():
            backup, i = backup.with_name(f"{stamp}-{i}.py"), i + 1
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_text(path.read_text())
        said += f"; your file is kept as {backup.relative_to(ROOT) if backup.is_relative_to(ROOT) else backup}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return said


def stale(root: str | os.PathLike = ROOT, ci: bool | None = None) -> list[str]:
    """The generated files under ``root`` (a copy of the repository's layout) that differ from
    the generator, as paths relative to it. A learner's ``exercises/`` file counts only in CI
    (``ci``; default: ``$CI`` set) or while it is identical to git HEAD's (so an untouched stub
    that is stale is caught, a learner's work never is; without git, only in CI); ``solutions/``
    always counts, and so does a file no exercise generates there."""
    root = Path(root)
    ci = bool(os.environ.get("CI")) if ci is None else ci
    files, problems = outputs()
    out = [f"cannot generate: {p}" for p in problems]
    for path, text in files.items():
        rel = path.relative_to(ROOT)
        target = root / rel
        if rel.parts[0] == "exercises" and not ci and not untouched(target, root):
            continue
        if not target.exists() or target.read_text() != text:
            out.append(str(rel))
    want = {p.relative_to(ROOT) for p in files}
    for folder in ("solutions",) + (("exercises",) if ci else ()):
        out += sorted(str(p.relative_to(root)) + " (no exercise generates it)"
                      for p in (root / folder).glob("ex*.py") if p.relative_to(root) not in want)
    return out


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
    ap.add_argument("--clauses", action="store_true",
                    help="print every core's contract clauses and the graded tests that observe each")
    ap.add_argument("--count", action="store_true",
                    help="print the lines a learner writes per exercise (non-blank, non-comment lines "
                         "of its marked regions) and the total")
    a = ap.parse_args(argv)
    if a.clauses:
        from .contracts import clause_table_text
        print(clause_table_text())
        if not (a.write or a.check or a.count):
            return 0
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
