"""The project's own consistency: dependencies, exercises against solutions, CLI entry points."""
import importlib
import inspect
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from minipar import grade

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
    spec = _pip_deps()["torch"]
    assert spec == "torch>=2.4,<3"
    import torch
    major, minor = map(int, torch.__version__.split(".")[:2])
    assert (2, 4) <= (major, minor) < (3, 0)


def _params(f):
    """Parameter names, kinds and defaults (annotations may be strings or objects)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


def _functions(module):
    return {n: _params(f) for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")}


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "exercises").glob("ex*.py")))
def test_exercise_matches_its_solution_and_the_library(name):
    ex = importlib.import_module(f"exercises.{name}")
    sol = importlib.import_module(f"solutions.{name}")
    assert _functions(ex) == _functions(sol), "exercise and solution must define the same functions"
    graded = ROOT / "tests" / "graded" / f"test_{name}.py"
    assert graded.exists(), f"no graded tests for {name}"
    lib = importlib.import_module(re.search(r'LIBRARY = "([\w.]+)"', graded.read_text()).group(1))
    for fname, sig in _functions(ex).items():
        assert hasattr(lib, fname), f"{fname} is not a library function of {lib.__name__}"
        assert _params(getattr(lib, fname)) == sig, f"{fname}: signature differs from the library's"
    assert "raise NotImplementedError" in inspect.getsource(ex), f"{name} has no stub left to write"


def test_bench_lists_its_benchmarks():
    out = subprocess.run([sys.executable, "-m", "minipar.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "launch" in out.stdout and "collectives" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "minipar.bench", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


def test_grade_knows_every_exercise():
    names = grade.exercises()
    assert names[0] == "ex01"
    assert names == sorted({p.stem.split("_")[0] for p in (ROOT / "exercises").glob("ex*.py")})
    with pytest.raises(ValueError, match="no graded exercise"):
        grade.test_file("ex99")


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "python3 course.py lab" in readme and "python3 course.py test" in readme
    assert "python3 course.py test" in (ROOT / ".ci" / "run").read_text()
