"""Grade an exercise: ``python -m minipar.grade ex01`` or ``minipar.grade("ex01")``.

Runs the exercise's graded tests (``tests/graded/test_ex01_*.py``) against your file in
``exercises/`` (or ``--solution``: against ``solutions/``) in a fresh pytest process, then
prints one line per test, a hint for each failure, and the score. The same tests check
the library and the solutions in CI."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

from .exercise import GRADED, ROOT  # the repository, and its graded tests


@dataclass
class Report:
    exercise: str
    target: str
    tests: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(t["outcome"] == "passed" for t in self.tests)

    @property
    def score(self) -> float:
        """Fraction of graded tests passed (0.0 to 1.0)."""
        return self.passed / len(self.tests) if self.tests else 0.0

    def __str__(self) -> str:
        lines = [f"{self.exercise} ({self.target}):"]
        for t in self.tests:
            ok = t["outcome"] == "passed"
            title = t["doc"].splitlines()[0] if t["doc"] else t["name"]
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {t['name']}: {title}")
            if not ok:
                hints = [ln.strip() for ln in t["doc"].splitlines() if ln.strip().startswith("Hint:")]
                lines += ["        " + h for h in [_short_error(t["error"] or t["outcome"]), *hints]]
        lines.append(f"score: {self.passed}/{len(self.tests)} ({100 * self.score:.0f}%)")
        return "\n".join(lines)


def _short_error(err: str) -> str:
    """The line a learner needs: a rank's own exception rather than the launcher's wrapper."""
    err = err.strip()
    if "RankError: " in err:
        err = err.split("RankError: ", 1)[1].split("--- ", 1)[0]
    return textwrap.shorten(" ".join(err.splitlines()[:3]), 240)


def exercises() -> list[str]:
    """Short names of the graded exercises: ['ex01', ...]."""
    return sorted({p.name.split("_")[1] for p in GRADED.glob("test_ex*_*.py")})


def test_file(exercise: str) -> Path:
    found = sorted(GRADED.glob(f"test_{exercise.split('_')[0]}_*.py"))
    if not found:
        raise ValueError(f"no graded exercise {exercise!r}; known: {', '.join(exercises())}")
    return found[0]


def grade(exercise: str, target: str = "exercise", verbose: bool = True,
          timeout: float = 600) -> Report:
    """Grade ``exercise`` (e.g. ``"ex01"``) for ``target`` ``"exercise"`` (your file),
    ``"solution"`` or ``"library"``; prints the report when ``verbose``; returns it."""
    return grade_many([exercise], target, verbose, timeout)[0]


def grade_many(names: list[str], target: str = "exercise", verbose: bool = True,
               timeout: float = 1800) -> list[Report]:
    """:func:`grade` for several exercises in one pytest process (one start-up for all)."""
    if target not in ("exercise", "solution", "library"):
        raise ValueError("target must be 'exercise', 'solution' or 'library'")
    paths = [test_file(n) for n in names]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = dict(os.environ, MINIPAR_GRADE_REPORT=str(out))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [sys.executable, "-m", "pytest", *map(str, paths), f"--impl={target}", "-q",
               "-p", "minipar._grade_plugin", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"the grader could not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results = json.loads(out.read_text())
    reports = [Report(p.stem.removeprefix("test_"), target,
                      [t for t in results if Path(t.get("file", "")).name == p.name]) for p in paths]
    for report in reports if verbose else []:
        print(report)
    return reports


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipar.grade", description=__doc__.splitlines()[0])
    p.add_argument("exercise", nargs="?", help="e.g. ex01 (omit with --all)")
    p.add_argument("--solution", action="store_true", help="grade solutions/ instead of exercises/")
    p.add_argument("--all", action="store_true", help="grade every exercise")
    a = p.parse_args(argv)
    names = exercises() if a.all or not a.exercise else [a.exercise]
    reports = grade_many(names, "solution" if a.solution else "exercise")
    return 0 if all(r.score == 1.0 for r in reports) else 1


class _CallableModule(types.ModuleType):
    """Lets ``minipar.grade("ex01")`` call :func:`grade` while ``python -m minipar.grade``
    runs this module: the module and the function share one name."""

    def __call__(self, exercise: str, target: str = "exercise", verbose: bool = True) -> Report:
        return grade(exercise, target=target, verbose=verbose)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
