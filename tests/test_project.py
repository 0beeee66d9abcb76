"""The project's own consistency: dependencies, exercises generated from the library, CLI entry points.

A learner's ``exercises/`` is theirs: the stubs are checked as the generator writes them (in a
temporary directory), and a committed ``exercises/`` file's freshness only in CI (``$CI`` set) or
while it is identical to git HEAD's; ``solutions/`` always."""
import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from minipar.course import exercise, exercise_files, grade, markers

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}


def _pip_deps():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"] + meta["optional-dependencies"]["test"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}


def _conda_deps():
    """Packages under ``dependencies:`` (not the channels, python, pip or the -e install)."""
    text = (ROOT / "environment.yml").read_text().split("dependencies:", 1)[1]
    out = {}
    for line in text.splitlines():
        m = re.match(r"  -\s+([A-Za-z0-9_.-]+)(.*)$", line)
        if m and m.group(1) not in ("python", "pip"):
            out[m.group(1).lower()] = m.group(2).strip()
    return out


def test_environment_yml_matches_pyproject():
    pip, conda = _pip_deps(), _conda_deps()
    assert {CONDA_NAMES.get(k, k) for k in pip} == set(conda), (sorted(pip), sorted(conda))
    for name, spec in pip.items():
        assert conda[CONDA_NAMES.get(name, name)] == spec[len(name):], (spec, conda[CONDA_NAMES.get(name, name)])


def test_torch_requirement_admits_the_tested_version():
    """The floor is deliberate: what Colab and Kaggle ship (2.11) and two releases older,
    tested on demand with ``python3 course.py test --torch 2.9.0 -k launch``."""
    spec = _pip_deps()["torch"]
    assert spec == "torch>=2.9,<3"
    import torch
    major, minor = map(int, torch.__version__.split(".")[:2])
    assert (2, 9) <= (major, minor) < (3, 0)


def _defs(tree, prefix=""):
    """{qualname: def node} of the module functions and (nested) class methods in ``tree``."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[prefix + node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update(_defs(node, f"{prefix}{node.name}."))
    return out


def _source(path, node, drop):
    """The def's lines (decorators included), dedented, without the lines ``drop`` says."""
    lines = Path(path).read_text().splitlines()
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    # a closing marker may follow the def's last statement: take the lines up to it
    last = node.end_lineno
    while last < len(lines) and re.match(r"\s*# <<< ex\d+", lines[last]):
        last += 1
    head = node.body[0]    # the docstring: the library's explains, the files' is the contract
    doc = range(head.lineno - 1, head.end_lineno) if isinstance(head, ast.Expr) and \
        isinstance(head.value, ast.Constant) and isinstance(head.value.value, str) else range(0)
    kept, inside = [], False
    for i, ln in enumerate(lines[first:last], start=first):
        inside, skip = drop(ln, inside)
        if not skip and i not in doc:
            kept.append(ln)
    return textwrap.dedent("\n".join(kept))


def _minus_regions(ln, inside):
    """The library without its marked regions (markers, hints and code)."""
    if re.match(r"\s*# >>> ex\d+", ln):
        return True, True
    if re.match(r"\s*# <<< ex\d+", ln):
        return False, True
    return inside, inside


def _minus_markers(ln, inside):
    """The library with its marked code kept: only the markers and hints go."""
    return inside, bool(re.match(r"\s*# (>>>|<<<) ex\d+|\s*# Hint:", ln))


def _minus_stubs(ln, inside):
    """An exercise file without its hint lines and stub raises."""
    return inside, bool(re.match(r'\s*# Hint:|\s*raise NotImplementedError\("Exercise \d+', ln))


@pytest.mark.parametrize("key", exercise.exercises())
def test_stub_is_the_library_minus_its_marked_regions(key, tmp_path):
    """Every function and method of the stub exNN (classes and _-prefixed names included) is
    the library's minus its marked regions, and solutions/exNN has the library's code itself;
    the files hold nothing else. The stub checked is the generator's (freshly written to a
    temporary directory), not the learner's exercises/ file (its freshness:
    :func:`test_committed_exercises_and_solutions_are_generated`)."""
    name = exercise.stem(key)
    marked = {p.qualname: p for p in exercise.pieces(key)}
    assert marked, f"{key}: no marked regions"
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / f"{name}.py").write_text(exercise_files.render(key, solution=False))
    for folder, drop in (("exercises", _minus_stubs), ("solutions", _minus_markers)):
        path = (tmp_path if folder == "exercises" else ROOT) / folder / f"{name}.py"
        defs = _defs(ast.parse(path.read_text()))
        assert set(defs) == set(marked), f"{path.name}: {sorted(set(defs) ^ set(marked))}"
        for qualname, piece in marked.items():
            lib = _defs(ast.parse(piece.path.read_text()))[qualname]
            want = _source(piece.path, lib, _minus_regions if folder == "exercises" else _minus_markers)
            package = importlib.import_module(piece.module).__package__   # relative imports made absolute
            want = "\n".join(exercise_files.absolute_import(ln, package) for ln in want.splitlines())
            assert _source(path, defs[qualname], drop) == want, f"{folder}/{name}.py: {qualname} differs"
            contract = textwrap.indent(textwrap.dedent("\n".join(markers.contract_docstring(piece, key))), "    ")
            assert (ast.get_docstring(defs[qualname]) or "") == \
                (ast.get_docstring(ast.parse(f"def f():\n{contract}\n    pass").body[0]) if contract else ""), \
                f"{folder}/{name}.py: {qualname}'s docstring is not its contract"
        if folder == "exercises":
            text = path.read_text()
            for qualname, piece in marked.items():
                for r in piece.regions:
                    if r.exercise == key:
                        assert f'raise NotImplementedError("{r.label()}: {qualname}")' in text


def test_exercise_swaps_the_library_functions_and_restores_them(tmp_path, monkeypatch):
    """Inside ``minipar.course.exercise`` the library's own function object runs the stub (or the
    solution), through any reference to it; outside, the library's code is back. The stub is the
    generator's, in a temporary directory (``$MINIPAR_EXERCISES``), not the learner's file."""
    (tmp_path / f"{exercise.stem('ex04')}.py").write_text(exercise_files.render("ex04", solution=False))
    monkeypatch.setenv(exercise.EXERCISES_ENV, str(tmp_path))
    import minipar
    from minipar import pipeline
    from minipar.pipeline import schedules
    held, code = schedules.one_f_one_b, schedules.one_f_one_b.__code__
    want = [(a.op, a.microbatch) for a in held(4, 6, 1)]
    with minipar.exercise("ex04"):
        with pytest.raises(NotImplementedError, match="Exercise 04 B: one_f_one_b"):
            held(4, 6, 1)
        with pytest.raises(NotImplementedError, match="Exercise 04 B: one_f_one_b"):
            pipeline.make_schedule("1f1b", 4, 6)
        with minipar.exercise("ex04", target="solution"):        # nested: the innermost wins
            assert [(a.op, a.microbatch) for a in held(4, 6, 1)] == want
            assert minipar.course.exercise.active() == [("ex04", "exercise"), ("ex04", "solution")]
        with pytest.raises(NotImplementedError):
            held(4, 6, 1)
    assert held.__code__ is code and minipar.course.exercise.active() == []
    with pytest.raises(ValueError, match="target"):
        minipar.exercise("ex04", target="mine").__enter__()


def test_committed_exercises_and_solutions_are_generated():
    """solutions/ is exactly what ``python -m minipar.course.exercise --write`` writes, and so is
    every exercises/ file in CI (``$CI`` set) or while it is identical to git HEAD's: a learner's
    solved or broken file is theirs (:func:`minipar.course.exercise_files.stale`)."""
    assert exercise_files.stale(ROOT) == []


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=course", "-c", "user.email=course@localhost",
                    "-c", "commit.gpgsign=false", *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_solved_or_broken_workspace_keeps_the_freshness_check_green(tmp_path):
    """A copy of the repository's exercises/ and solutions/, committed, then every solution
    copied into exercises/ and one file broken: the check passes (CI unset), and names every
    changed exercise in CI. An untouched committed stub that is stale is still caught, without
    CI; without git, exercises/ is checked in CI only and solutions/ always."""
    for folder in ("exercises", "solutions"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", ".backup"))
    for k in exercise.exercises():          # the pristine stubs, committed
        (tmp_path / "exercises" / f"{exercise.stem(k)}.py").write_text(exercise_files.render(k, solution=False))
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "stubs")
    names = [exercise.stem(k) for k in exercise.exercises()]
    assert exercise_files.stale(tmp_path, ci=False) == [] and exercise_files.stale(tmp_path, ci=True) == []
    for name in names:                       # every solution copied in; the first broken
        shutil.copy(tmp_path / "solutions" / f"{name}.py", tmp_path / "exercises" / f"{name}.py")
    (tmp_path / "exercises" / f"{names[0]}.py").write_text("def broken(:\n")
    assert exercise_files.stale(tmp_path, ci=False) == []
    assert exercise_files.stale(tmp_path, ci=True) == [f"exercises/{n}.py" for n in names]
    # an untouched stub that the generator no longer writes: caught without CI
    _git(tmp_path, "checkout", "-q", "--", f"exercises/{names[1]}.py")
    (tmp_path / "exercises" / f"{names[1]}.py").write_text("# stale\n")
    _git(tmp_path, "commit", "-q", "-m", "a stale stub", "--", f"exercises/{names[1]}.py")
    assert exercise_files.stale(tmp_path, ci=False) == [f"exercises/{names[1]}.py"]
    # no git (an installed course): exercises/ only in CI; solutions/ always
    shutil.rmtree(tmp_path / ".git")
    assert exercise_files.stale(tmp_path, ci=False) == []
    (tmp_path / "solutions" / f"{names[2]}.py").write_text("# stale\n")
    assert exercise_files.stale(tmp_path, ci=False) == [f"solutions/{names[2]}.py"]


def test_bench_lists_its_benchmarks():
    out = subprocess.run([sys.executable, "-m", "minipar.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "launch" in out.stdout and "collectives" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "minipar.bench", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


def test_grade_knows_every_exercise():
    names = grade.exercises()
    assert names[0] == "ex01"
    assert names == sorted({p.stem.split("_")[0] for p in (ROOT / "solutions").glob("ex*.py")})
    assert names == exercise.exercises(), "every graded exercise has marked code, and the other way round"
    with pytest.raises(ValueError, match="no graded exercise"):
        grade.test_file("ex99")


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "python3 course.py lab" in readme and "python3 course.py test" in readme
    assert "python3 course.py test" in (ROOT / ".ci" / "run").read_text()


def _code_lines(text: str) -> int:
    return sum(1 for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#"))


def test_learner_lines_are_the_solutions_lines_the_stub_leaves_out():
    """``markers.learner_lines``: the solution's code lines minus the stub's (each region's one
    ``raise`` aside), and ``--count`` prints them with their total."""
    from minipar.course import markers
    counts = {}
    for k in exercise.exercises():
        regions = sum(1 for p in exercise.pieces(k) for r in p.regions if r.exercise == k)
        stub, solution = exercise_files.render(k, solution=False), exercise_files.render(k, solution=True)
        counts[k] = markers.learner_lines(k)
        assert counts[k] == _code_lines(solution) - (_code_lines(stub) - regions) > 0, k
    out = subprocess.run([sys.executable, "-m", "minipar.course.exercise", "--count"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert [f"| {k} | {n} |" for k, n in counts.items()] + [f"| all | {sum(counts.values())} |"] == \
        out.stdout.splitlines()[2:]
